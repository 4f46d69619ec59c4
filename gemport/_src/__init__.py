"""gemport's internals: helpers the public modules share. Not API; they may change without notice."""
