"""Wrong answers to notebook 05's exercises: each must make its graded cell fail (tests/wrong_answers/README.md)."""

WRONG = {
    "exercise_1": {
        "removes only the print: .item() still turns a tensor into a Python number, a graph break": '''
def leaky_fixed(x):
    y = x * 3
    if y.max().item() > 1:
        y = y / y.max()
    return torch.nn.functional.leaky_relu(y)
''',
        "a Python if on a tensor: data-dependent control flow breaks the graph too": '''
def leaky_fixed(x):
    y = x * 3
    if y.max() > 1:
        y = y / y.max()
    return torch.nn.functional.leaky_relu(y)
''',
        "always divides: drops the branch instead of expressing it as tensor operations": '''
def leaky_fixed(x):
    y = x * 3
    return torch.nn.functional.leaky_relu(y / y.max())
''',
        "divides by the largest magnitude, not the largest value": '''
def leaky_fixed(x):
    y = x * 3
    peak = y.abs().max()
    return torch.nn.functional.leaky_relu(torch.where(peak > 1, y / peak, y))
''',
            "compares element by element: only the elements above 1 are divided": '''
def leaky_fixed(x):
    y = x * 3
    return torch.nn.functional.leaky_relu(torch.where(y > 1, y / y.max(), y))
''',
        "tests x's peak instead of y's (x * 3)": '''
def leaky_fixed(x):
    y = x * 3
    peak = y.max()
    return torch.nn.functional.leaky_relu(torch.where(x.max() > 1, y / peak, y))
''',
        "float() of the peak: a Python number again, a graph break": '''
def leaky_fixed(x):
    y = x * 3
    peak = float(y.max())
    return torch.nn.functional.leaky_relu(y / peak if peak > 1 else y)
''',
        "relu instead of leaky_relu": '''
def leaky_fixed(x):
    y = x * 3
    peak = y.max()
    return torch.relu(torch.where(peak > 1, y / peak, y))
''',
        "divides each row by its own peak: right on 1-D inputs, a per-row max on 2-D ones": '''
def leaky_fixed(x):
    y = x * 3
    peak = y.amax(dim=-1, keepdim=True)
    return torch.nn.functional.leaky_relu(torch.where(peak > 1, y / peak, y))
''',
        "keeps the print: a side effect Dynamo does not put in a graph": '''
def leaky_fixed(x):
    y = x * 3
    print("scaling done")
    peak = y.max()
    return torch.nn.functional.leaky_relu(torch.where(peak > 1, y / peak, y))
''',
        "clamps at 1 instead of dividing by the peak": '''
def leaky_fixed(x):
    y = x * 3
    return torch.nn.functional.leaky_relu(y.clamp(max=1.0))
''',
        "blends the two branches arithmetically: NaN where the peak is 0 (0 / 0 times 0)": '''
def leaky_fixed(x):
    y = x * 3
    peak = y.max()
    divide = (peak > 1).to(y.dtype)
    return torch.nn.functional.leaky_relu(y / peak * divide + y * (1 - divide))
''',
    },
    "exercise_2": {
        "the default: static first, dynamic only after a second shape": '''
def compile_for_variable_shapes(model, backend):
    return torch.compile(model, backend=backend)
''',
        "dynamic=False: every shape compiles": '''
def compile_for_variable_shapes(model, backend):
    return torch.compile(model, backend=backend, dynamic=False)
''',
        "fullgraph=True: no graph breaks, but still one compilation per new kind of shape": '''
def compile_for_variable_shapes(model, backend):
    return torch.compile(model, backend=backend, fullgraph=True)
''',
        "marks only the length dynamic: the short last batch recompiles": '''
def compile_for_variable_shapes(model, backend):
    compiled = torch.compile(model, backend=backend)
    def run(tokens):
        torch._dynamo.mark_dynamic(tokens, 1)
        return compiled(tokens)
    return run
''',
        "returns the model uncompiled": '''
def compile_for_variable_shapes(model, backend):
    return model
''',
        "ignores the backend it is given": '''
def compile_for_variable_shapes(model, backend):
    return torch.compile(model, backend="eager", dynamic=True)
''',
        "marks only the rows dynamic: a new length recompiles": '''
def compile_for_variable_shapes(model, backend):
    compiled = torch.compile(model, backend=backend)
    def run(tokens):
        torch._dynamo.mark_dynamic(tokens, 0)
        return compiled(tokens)
    return run
''',
        "switches Dynamo's global setting instead of passing dynamic=True: every later compile changes too": '''
def compile_for_variable_shapes(model, backend):
    torch._dynamo.config.assume_static_by_default = False
    return torch.compile(model, backend=backend)
''',
        "dynamic=True, and caps Dynamo's global recompile limit at 1 to be sure": '''
def compile_for_variable_shapes(model, backend):
    torch._dynamo.config.recompile_limit = 1
    return torch.compile(model, backend=backend, dynamic=True)
''',
        "compiles only the MLP, in place: the embedding runs eagerly and the model's state_dict keys change": '''
def compile_for_variable_shapes(model, backend):
    model.mlp = torch.compile(model.mlp, backend=backend, dynamic=True)
    return model
''',
    },
}
