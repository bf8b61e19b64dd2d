"""Wrong answers to notebook 16's exercises: the mistakes learners make (format: tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "moves the step on but leaves the data position one batch behind": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    repaired["position"]["step"] = repaired["scheduler"]["last_epoch"]
    return repaired
''',
        "adds one step to every checkpoint, a correct one too": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["position"]["step"] + 1
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return repaired
''',
        "repairs the checkpoint it was given in place": '''
def repair(checkpoint):
    step = checkpoint["scheduler"]["last_epoch"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    checkpoint["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return checkpoint
''',
        "divides the step by the batch size, not by the batches per epoch": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["scheduler"]["last_epoch"]
    epoch, batch = divmod(step, BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return repaired
''',
        "takes the step from AdamW's counter, which lags when the GradScaler skipped steps (the hint's trap)": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = int(repaired["optimizer"]["state"][0]["step"])
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return repaired
''',
        "takes the scheduler's _step_count, which its constructor's first step() made one too many": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["scheduler"]["_step_count"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return repaired
''',
        "advances the batch by one but never wraps it into the next epoch": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["scheduler"]["last_epoch"]
    if step != repaired["position"]["step"]:
        repaired["position"] = {"step": step, "epoch": repaired["position"]["epoch"],
                                "batch": repaired["position"]["batch"] + 1}
    return repaired
''',
        "guesses from the position alone: adds one step unless the batch is 0": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["position"]["step"] + 1 if repaired["position"]["batch"] != 0 else repaired["position"]["step"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    return repaired
''',
        "also sets AdamW's step counters to the repaired step (changes the optimizer, not only the position)": '''
def repair(checkpoint):
    repaired = copy.deepcopy(checkpoint)
    step = repaired["scheduler"]["last_epoch"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"] = {"step": step, "epoch": epoch, "batch": batch}
    for state in repaired["optimizer"]["state"].values():
        state["step"] = torch.tensor(float(step))
    return repaired
''',
        "rebuilds the checkpoint from the model, optimizer, scheduler and position only (drops the rest)": '''
def repair(checkpoint):
    step = checkpoint["scheduler"]["last_epoch"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    return {"model": copy.deepcopy(checkpoint["model"]), "optimizer": copy.deepcopy(checkpoint["optimizer"]),
            "scheduler": copy.deepcopy(checkpoint["scheduler"]),
            "position": {"step": step, "epoch": epoch, "batch": batch}}
''',
        "a shallow copy whose position it edits in place (the caller's checkpoint changes too)": '''
def repair(checkpoint):
    repaired = copy.copy(checkpoint)
    step = repaired["scheduler"]["last_epoch"]
    epoch, batch = divmod(step, NUM_SAMPLES // BATCH_SIZE)
    repaired["position"].update(step=step, epoch=epoch, batch=batch)
    return repaired
''',
    },
    "exercise_2": {
        "sorts the file names as text: step-9 comes after step-13": '''
def newest_loadable(folder):
    for path in sorted(folder.glob("step-*.pt"), reverse=True):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            continue
    if list(folder.glob("step-*.pt")):
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "takes the most recently modified file as the newest": '''
def newest_loadable(folder):
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in paths:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            continue
    if paths:
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "loads with weights_only=False: the planted file runs its code": '''
def newest_loadable(folder):
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]), reverse=True)
    for path in paths:
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception:
            continue
    if paths:
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "reads every file in the folder, a killed writer's temporary file too": '''
def newest_loadable(folder):
    steps = {}
    for path in folder.iterdir():
        digits = "".join(c for c in path.name if c.isdigit())
        if path.is_file() and digits:
            steps[int(digits)] = path
    for step in sorted(steps, reverse=True):
        try:
            return torch.load(steps[step], map_location="cpu", weights_only=True)
        except Exception:
            continue
    if steps:
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "starts from step 0 when nothing loads": '''
def newest_loadable(folder):
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]), reverse=True)
    for path in paths:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            continue
    return None
''',
        "tries only the newest file": '''
def newest_loadable(folder):
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not paths:
        return None
    try:
        return torch.load(paths[-1], map_location="cpu", weights_only=True)
    except Exception:
        return None
''',
        "deletes the files it cannot load (the folder changes)": '''
def newest_loadable(folder):
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]), reverse=True)
    for path in paths:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            path.unlink()
    if paths:
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "treats step 0 as 'no checkpoint' (a falsy test of the step)": '''
def newest_loadable(folder):
    steps = sorted((int(p.stem.split("-")[1]) for p in folder.glob("step-*.pt")), reverse=True)
    for step in steps:
        if not step:
            return None
        try:
            return torch.load(folder / f"step-{step}.pt", map_location="cpu", weights_only=True)
        except Exception:
            continue
    if steps:
        raise RuntimeError("no checkpoint loads")
    return None
''',
        "catches only the unpickler's error: a truncated file raises something else": '''
def newest_loadable(folder):
    import pickle
    paths = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]), reverse=True)
    for path in paths:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            continue
    if paths:
        raise RuntimeError("no checkpoint loads")
    return None
''',
    },
}
