"""Data: sources (download, verify, decode, cache), image folders and prepared shards, the on-device loader and its
batch augmentations. Import the module that does the job (speedrun.data.sources.load_dataset, ...): this package
imports nothing itself, so that `speedrun data prepare` loads no torch."""
