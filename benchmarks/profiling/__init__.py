"""The passes `benchmarks/profile.py` profiles, one module each: `forward`, `backward`,
`decode`, `decode_mla` (`--pass decode --shape mla`), `one_layer`, `block_backward`,
`account` (every launch of a whole backward call, attributed)."""
