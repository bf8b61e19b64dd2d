"""Wrong answers to notebook 10's exercises: each must make its graded cell fail (see README.md here).

Each is the notebook's solution with one mistake a learner makes, written whole.
"""


def _census(overflow: str = "x.abs() > edge if max_is_even else x.abs() >= edge",
            mantissa: str = "{torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]",
            rounded: str = "x.clamp(-info.max, info.max).to(dtype).float()",
            flushed: str = "(rounded == 0) & (x != 0)",
            subnormal: str = "(rounded != 0) & (rounded.abs() < info.smallest_normal)") -> str:
    return f'''
def unscaled_fp8_census(x, dtype):
    info = torch.finfo(dtype)
    mantissa_bits = {mantissa}
    top_gap = 2.0 ** (math.floor(math.log2(info.max)) - mantissa_bits)
    edge = info.max + top_gap / 2
    max_is_even = (info.max / top_gap) % 2 == 0
    overflow = {overflow}
    rounded = {rounded}
    return {{"overflow": int(overflow.sum()), "flushed": int(({flushed}).sum()),
            "subnormal": int(({subnormal}).sum())}}
'''


def _state(kv_width: str = 'width // config["num_attention_heads"] * config["num_key_value_heads"]',
           codes: str = "out_features * in_features // 2",
           scales: str = "blocks + 4 * math.ceil(blocks / 256) + 4",
           adapters: str = "4 * 4 * rank * (in_features + out_features) + 2 * 4",
           embeddings: str = 'config["vocab_size"] * width * (1 if config["tie_word_embeddings"] else 2)',
           other: str = "embeddings + (2 * layers + 1) * width",
           total: str = "layers * total + (4 if prepared else 2) * other") -> str:
    return f'''
def qlora_state_bytes(config, rank, block_size=64, prepared=False):
    width, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv_width = {kv_width}
    linears = [(width, width), (kv_width, width), (kv_width, width), (width, width), (ffn, width), (ffn, width),
               (width, ffn)]
    total = 0
    for out_features, in_features in linears:
        blocks = out_features * in_features // block_size
        total += {codes}
        total += {scales}
        total += {adapters}
    embeddings = {embeddings}
    other = {other}
    return {total}
'''


WRONG = {
    "exercise_1": {
        "overflow counted above the largest finite value, not above the halfway point past it":
            _census(overflow="x.abs() > info.max"),
        "overflow read from the cast's output (inf or NaN), which saturates e4m3fn silently":
            _census(overflow="~x.to(dtype).float().isfinite()"),
        "the halfway tie above the largest value always rounds up (overflow), as in e5m2":
            _census(overflow="x.abs() >= edge"),
        "the halfway tie above the largest value always rounds down (no overflow), as in e4m3fn":
            _census(overflow="x.abs() > edge"),
        "e5m2 given e4m3's three mantissa bits (the gap at the top is wrong)":
            _census(mantissa="3"),
        "flushed counted below the smallest subnormal, ignoring values that round up to it":
            _census(flushed="(x != 0) & (x.abs() < info.smallest_normal * 2.0 ** -mantissa_bits)"),
        "flushed counts the zeros that were zero already":
            _census(flushed="rounded == 0"),
        "subnormal judged on the input, not on the rounded value":
            _census(subnormal="(x != 0) & (x.abs() < info.smallest_normal)"),
        "rounds through bf16 first (a double rounding that breaks ties)":
            _census(rounded="x.to(torch.bfloat16).float().clamp(-info.max, info.max).to(dtype).float()"),
    },
    "exercise_2": {
        "key and value projections as wide as the queries (grouped-query attention ignored)":
            _state(kv_width="width"),
        "one byte per 4-bit code (no packing)": _state(codes="out_features * in_features"),
        "the second-level scales rounded down": _state(scales="blocks + 4 * (blocks // 256) + 4"),
        "forgets the fp32 offset (the absmaxes' mean) of each weight":
            _state(scales="blocks + 4 * math.ceil(blocks / 256)"),
        "fp32 absmaxes, as if double quantisation were off": _state(scales="4 * blocks"),
        "counts the head even when it is tied to the embeddings": _state(embeddings='2 * config["vocab_size"] * width'),
        "forgets the final RMSNorm": _state(other="embeddings + 2 * layers * width"),
        "forgets AdamW's step counters": _state(adapters="4 * 4 * rank * (in_features + out_features)"),
        "counts one AdamW moment, not two": _state(adapters="3 * 4 * rank * (in_features + out_features) + 2 * 4"),
        "prepare upcasts only the embeddings and the head, not the norms": _state(
            total="layers * total + (4 if prepared else 2) * embeddings + 2 * (other - embeddings)"),
    },
}
