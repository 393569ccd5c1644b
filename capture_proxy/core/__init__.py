"""The pure core: records, codecs, chain building, routing, capture transforms, stream assembly.

Nothing in this package imports aiohttp or does I/O. Adapters depend on it, never the reverse.
"""
