"""Layer indexes: the table of contents and seekable blocks of an unmodified
gzip (or plain) tar layer, so single files can be served without the rest."""
