"""bootseer: start large ML training jobs fast. This package holds the CLI,
configuration and logging set-up shared by every daemon."""
