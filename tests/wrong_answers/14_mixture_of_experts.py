"""Wrong answers to notebook 14's exercises: each replaces the solution cell, and the graded cell must fail on it."""


def _capacity(capacity: str = "math.ceil(capacity_factor * pairs / num_experts)",
              kept: str = "int(counts.clamp(max=capacity).sum())",
              per_token: str = "4 * width + 4 * num_experts + 12 * top_k + 4",
              buffer_rows: str = "num_experts * capacity",
              expert_row: str = "4 * width + 16 * ffn",
              kept_row: str = "8 * width + 16",
              dropped: str = "pairs - kept") -> str:
    """A whole solution of exercise 1 with one expression replaced."""
    return (
        "def predict_capacity_layer(routing, num_experts, capacity_factor, width, ffn):\n"
        "    num_tokens, top_k = routing.shape\n"
        "    pairs = num_tokens * top_k\n"
        f"    capacity = {capacity}\n"
        "    counts = torch.bincount(routing.flatten(), minlength=num_experts)\n"
        f"    kept = {kept}\n"
        f"    per_token = {per_token}\n"
        f"    saved = (num_tokens * per_token + pairs * (8 * width + 20) + {buffer_rows} * ({expert_row})\n"
        f"             + kept * ({kept_row}))\n"
        f"    return saved, {dropped}\n")


def _splits(destination: str = "routing // (num_experts // world)",
            flat: str = "destination[r].flatten()",
            receive: str = "[[send[p][r] for p in range(world)] for r in range(world)]",
            after: str = "") -> str:
    """A whole solution of exercise 2 with one expression replaced (``after``: a line before the return)."""
    return (
        "def all_to_all_splits(routing, num_experts):\n"
        "    world = routing.shape[0]\n"
        f"    destination = {destination}\n"
        f"    send = [torch.bincount({flat}, minlength=world).tolist() for r in range(world)]\n"
        f"    receive = {receive}\n"
        f"{after}"
        "    return send, receive\n")


WRONG = {
    "exercise_1": {
        "the capacity from the tokens, not the (token, slot) pairs":
            _capacity(capacity="math.ceil(capacity_factor * num_tokens / num_experts)"),
        "the capacity rounded down":
            _capacity(capacity="int(capacity_factor * pairs / num_experts)"),
        "every pair counted as kept (the drops forgotten in the bytes)":
            _capacity(kept="pairs"),
        "the buffer padded to the busiest expert, not to the capacity":
            _capacity(buffer_rows="num_experts * int(counts.max())"),
        "the router's per-token bytes left out":
            _capacity(per_token="0"),
        "the dropped pairs without clamping: experts under capacity give some back":
            _capacity(dropped="int((counts - capacity).sum())"),
        "the dropped pairs divided by k, as if tokens were dropped whole":
            _capacity(dropped="(pairs - kept) // top_k"),
    },
    "exercise_2": {
        "experts dealt to the ranks round-robin (expert % ranks), not in contiguous blocks":
            _splits(destination="routing % world"),
        "the experts per rank taken as the number of ranks":
            _splits(destination="routing // world"),
        "receive taken equal to send (no transpose)":
            _splits(receive="[list(row) for row in send]"),
        "only each token's first expert counted (k = 1)":
            _splits(flat="destination[r][:, 0]"),
        "a token's pairs for the same rank sent once (deduplicated)":
            _splits(flat="torch.cat([row.unique() for row in destination[r]])"),
        "a rank's rows for itself left out of the splits":
            _splits(after="    for r in range(world):\n        send[r][r] = 0\n        receive[r][r] = 0\n"),
        "send and receive returned the other way round":
            _splits(after="    send, receive = receive, send\n"),
        'bincount without minlength: a rank that sends nothing to the last ranks gets a short list': '''
def all_to_all_splits(routing, num_experts):
    world = routing.shape[0]
    destination = routing // (num_experts // world)
    send = [torch.bincount(destination[r].flatten()).tolist() for r in range(world)]
    receive = [[send[p][r] for p in range(world)] for r in range(world)]
    return send, receive
''',
    },
}
