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
    },
    "exercise_2": {
        "every call compiles again": "predicted_compilations = [1, 2, 3, 4, 5]\n",
        "no automatic dynamic shapes: each new length compiles": "predicted_compilations = [1, 1, 2, 3, 4]\n",
        "the guard checks only shapes, not the dtype": "predicted_compilations = [1, 1, 2, 2, 2]\n",
        "dynamic from the first call: only the dtype recompiles": "predicted_compilations = [1, 1, 1, 1, 2]\n",
    },
}
