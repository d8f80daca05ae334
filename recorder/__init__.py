"""Hot blocks: record which blocks an image's first run reads, publish them
as a manifest next to the image, and prefetch them on every later start."""
