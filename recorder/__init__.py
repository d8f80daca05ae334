"""Hot blocks: record which blocks an image's first run reads, publish them
as a manifest next to the image, and prefetch them on every later start.

Imports `snapshotter` (the layer index, the layer server's reader and
control channel, the registry client); imported only by the layer server's
composition root (`snapshotter/fs/server.py`) and by `bootseer`.
"""
