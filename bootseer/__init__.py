"""bootseer: start large ML training jobs fast.

This package is the application on top of the parts (snapshotter, recorder,
depsnap, hdfs_fuse): the `bootseer` command line, the configuration file
with one section per part, and the logging set-up every daemon shares. It
imports every part; no part imports it.
"""
