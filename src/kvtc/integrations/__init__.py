"""Engine adapters: each translates one engine's KV cache to and from :class:`kvtc.layout.KVSlice`."""
