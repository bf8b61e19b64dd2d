"""Wrong answers to notebook 10's exercises: each must make its graded cell fail (see README.md here)."""


def _e5m2(body: str) -> str:
    return "\ndef round_stochastic_e5m2(x):\n" + body


def _qlora(body: str) -> str:
    return '''
def qlora_step_bytes(model, rank, block_size=64, scale_block_size=256):
    linears = [m for block in model.blocks for m in (block.qkv, block.proj, block.mlp[0], block.mlp[2])]
''' + body + '''
    return total
'''


_REST_BF16 = "    total = 2 * (sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears))\n"


def _per_linear(codes: str = "linear.weight.numel() // 2",
                scales: str = "blocks + 4 * math.ceil(blocks / scale_block_size) + 4",
                adapter: str = "4 * 4 * adapter + 2 * 4", rest: str = _REST_BF16) -> str:
    return rest + f'''    for linear in linears:
        blocks = linear.weight.numel() // block_size
        total += {codes}
        total += {scales}
        adapter = rank * (linear.in_features + linear.out_features)
        total += {adapter}
'''


WRONG = {
    "exercise_1": {
        "rounds to the nearest value (no randomness)": _e5m2("    return x.half().to(torch.float8_e5m2)\n"),
        "truncates: cuts the low byte without adding noise (always rounds toward zero)": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    return (bits & -256).view(torch.float16).to(torch.float8_e5m2)\n"),
        "noise over 9 bits instead of the 8 that e5m2 drops (rounds up too often)": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    noise = torch.randint_like(bits, 0, 1 << 9)\n"
            "    return ((bits + noise) & -256).view(torch.float16).to(torch.float8_e5m2)\n"),
        "noise over 7 bits (rounds up too rarely)": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    noise = torch.randint_like(bits, 0, 1 << 7)\n"
            "    return ((bits + noise) & -256).view(torch.float16).to(torch.float8_e5m2)\n"),
        "one random number shared by every element": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    noise = torch.randint(0, 1 << 8, (1,), dtype=torch.int16, device=x.device)\n"
            "    return ((bits + noise) & -256).view(torch.float16).to(torch.float8_e5m2)\n"),
        "adds the noise but does not mask: the final cast rounds to nearest again": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    noise = torch.randint_like(bits, 0, 1 << 8)\n"
            "    return (bits + noise).view(torch.float16).to(torch.float8_e5m2)\n"),
        "returns the rounded fp16 tensor, not an e5m2 one": _e5m2(
            "    bits = x.half().contiguous().view(torch.int16)\n"
            "    noise = torch.randint_like(bits, 0, 1 << 8)\n"
            "    return ((bits + noise) & -256).view(torch.float16)\n"),
        "stochastic rounding to bf16 (fp32's top 16 bits), then a nearest cast to e5m2": _e5m2(
            "    bits = x.float().contiguous().view(torch.int32)\n"
            "    noise = torch.randint_like(bits, 0, 1 << 16)\n"
            "    return ((bits + noise) & -65536).view(torch.float32).to(torch.float8_e5m2)\n"),
    },
    "exercise_2": {
        "one byte per 4-bit code (no packing)": _qlora(_per_linear(codes="linear.weight.numel()")),
        "fp32 absmaxes, as if double quantisation were off": _qlora(_per_linear(scales="4 * blocks")),
        "forgets the fp32 offset (the absmaxes' mean) of each weight": _qlora(_per_linear(
            scales="blocks + 4 * math.ceil(blocks / scale_block_size)")),
        "rounds the number of second-level scales down": _qlora(_per_linear(
            scales="blocks + 4 * (blocks // scale_block_size) + 4")),
        "counts one AdamW moment, not two": _qlora(_per_linear(adapter="3 * 4 * adapter + 2 * 4")),
        "forgets the adapters' gradients": _qlora(_per_linear(adapter="4 * adapter + 2 * 4 * adapter + 2 * 4")),
        "forgets AdamW's step counters": _qlora(_per_linear(adapter="4 * 4 * adapter")),
        "counts the frozen rest (embeddings, norms, head, biases) in fp32": _qlora(_per_linear(
            rest="    total = 4 * (sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears))\n")),
        "forgets the biases of the quantised layers": _qlora(_per_linear(
            rest="    total = 2 * (sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in linears)"
                 " - sum(m.bias.numel() for m in linears))\n")),
    },
}
