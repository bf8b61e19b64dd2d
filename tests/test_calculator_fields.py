"""Exact or refused, field by field (issue 43): every field of every supported transformers config class, of peft's
LoraConfig, of torch.utils.checkpoint's keyword arguments, of the optimizers' constructors and every attention
implementation is replayed, listed as not changing training memory (with its reason), or refused when set away from
its default; a field a newer release adds fails here until someone decides. And the package's shape: one module per
family (nothing outside ``families/`` asks which family it holds), and no import circle anywhere in ``utils/``."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from utils import calculator as C
from utils.calculator import registry
from utils.calculator.from_transformers import ATTENTION_IMPLEMENTATIONS, CHECKPOINT_KWARGS, LORA_FIELDS
from utils.calculator.optimizers import OPTIMIZER_OPTIONS
from utils.calculator.validate_hf import tiny_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "gpt2": "GPT2Config",
                  "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig", "olmoe": "OlmoeConfig"}


def config_class(model_type):
    import transformers

    return getattr(transformers, CONFIG_CLASSES[model_type])


def class_fields(cls) -> dict:
    """Every field of a config class (its dataclass fields and ``__init__``'s arguments), with its default."""
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) and name != "self":
            fields.setdefault(name, parameter.default)
    fields.update({k: v for k, v in cls().to_dict().items() if k not in fields})
    return fields


def non_default(default):
    """A value other than ``default``, of its kind."""
    if isinstance(default, bool):
        return not default
    if default is None:
        return 7
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, dict):
        return {"x": 1}
    if isinstance(default, (list, tuple)):
        return ["x"]
    return default + 1


def test_every_supported_model_type_is_a_config_class_walked_here():
    assert set(registry.model_types()) == set(CONFIG_CLASSES)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_config_field_is_replayed_harmless_or_refused(model_type):
    family = registry.family_for_model_type(model_type)
    rules = family.rules[model_type].with_base()
    fields = class_fields(config_class(model_type))
    undecided = sorted(name for name in fields if name not in rules.decided() and not name.startswith("_")
                       and name != "model_type")
    assert not undecided, (f"{model_type}: transformers' config has fields the calculator has not decided on: "
                           f"{undecided}; replay them, list them as harmless (with the reason) or refuse them")
    assert all(isinstance(why, str) and len(why) > 8 for why in rules.no_effect.values())
    for name, default in family.rules[model_type].refused.items():   # its refusals name the field
        if name in fields:
            assert fields[name] == default or (not fields[name] and not default), (model_type, name)
        with pytest.raises(ValueError, match=re.escape(name)):
            C.model_config_from_hf(tiny_config(model_type, **{name: non_default(default)}))
    for name, value in getattr(family, "defaults", {}).get(model_type, {}).items():   # its defaults are transformers'
        assert fields[name] == value, (model_type, name, fields[name], value)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_a_field_no_release_had_is_refused_unless_unset(model_type):
    with pytest.raises(ValueError, match="a_field_from_a_newer_release=3 is not modelled"):
        C.model_config_from_hf(tiny_config(model_type, a_field_from_a_newer_release=3))
    C.model_config_from_hf(tiny_config(model_type, a_field_from_a_newer_release=None))
    for name in ("output_hidden_states", "output_attentions", "chunk_size_feed_forward"):
        with pytest.raises(ValueError, match=name):
            C.model_config_from_hf(tiny_config(model_type, **{name: 4}))


def test_every_lora_config_field_is_decided_and_refusals_are_named():
    from peft import LoraConfig

    names = {f.name for f in dataclasses.fields(LoraConfig)}
    assert names <= LORA_FIELDS.decided(), f"peft's LoraConfig has new fields: {sorted(names - LORA_FIELDS.decided())}"
    bad = {"inference_mode": True, "exclude_modules": ["o_proj"], "bias": "all", "modules_to_save": ["lm_head"],
           "layers_to_transform": [0], "rank_pattern": {"q_proj": 4}, "use_dora": True, "lora_bias": True,
           "target_parameters": ["mlp.experts.gate_up_proj"], "layer_replication": [[0, 1]]}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"LoraConfig {name}="):
            C.lora_overrides(LoraConfig(r=4, target_modules=["q_proj"], **{name: value}))
    setup = C.lora_overrides(LoraConfig(r=4, lora_alpha=32, use_rslora=True, target_modules="all-linear"))
    assert setup == {"lora_rank": 4, "lora_dropout": 0.0, "lora_targets": "all"}


def test_checkpoint_kwargs_attention_and_optimizer_options_are_decided():
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    arguments = set(inspect.signature(torch.utils.checkpoint.checkpoint).parameters) - {"function", "args", "kwargs"}
    assert arguments | {"preserve_rng_state"} <= CHECKPOINT_KWARGS.decided()
    assert C.predict_hf("llama-3.2-1b", seq_len=64, checkpointing="every_block",
                        gradient_checkpointing_kwargs={"use_reentrant": True}).setup.reentrant
    for name, value in (("early_stop", False), ("context_fn", lambda: None), ("use_reantrant", True)):
        with pytest.raises(ValueError, match=name):
            C.predict_hf("llama-3.2-1b", seq_len=64, gradient_checkpointing_kwargs={name: value})
    assert set(ALL_ATTENTION_FUNCTIONS) | {"eager"} <= set(ATTENTION_IMPLEMENTATIONS)
    for name, verdict in ATTENTION_IMPLEMENTATIONS.items():
        if verdict == "refused":
            with pytest.raises(ValueError, match=re.escape(name)):
                C.model_config_from_hf("llama-3.2-1b", attention=name)
    for optimizer, cls in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
                           ("adafactor", torch.optim.Adafactor)):
        rules = OPTIMIZER_OPTIONS[optimizer]
        decided = {*rules["replayed"], *rules["no_effect"], *rules["refused"]}
        arguments = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        assert arguments <= decided, f"{cls.__name__} has arguments the calculator has not decided on: " \
                                     f"{sorted(arguments - decided)}"
        for name, default in rules["refused"].items():
            with pytest.raises(ValueError, match=f"optimizer option {name}="):
                C.predict(C.PRESETS["1B"], C.TrainingSetup(seq_len=64, optimizer=optimizer,
                                                           optimizer_options={name: non_default(default)}))
    options = {"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": True}
    assert C.predict(C.PRESETS["1B"], C.TrainingSetup(seq_len=64, optimizer_options=options)).total == \
        C.predict(C.PRESETS["1B"], C.TrainingSetup(seq_len=64)).total


# --- the package's shape ---------------------------------------------------------------------------------------

def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path = ROOT / "utils") -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (anywhere in the file, inside functions too)."""
    modules = _modules(root)
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
                # `from package import submodule` imports the submodule; `from module import name`, the module
                targets = submodules if len(submodules) == len(node.names) else [base] + submodules
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_anywhere_in_utils():
    graph = import_graph()
    assert len(graph) > 40 and "utils.calculator.families.llama" in graph
    assert find_cycle(graph) is None, f"an import circle: {' -> '.join(find_cycle(graph))}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]   # the check can fail


def test_only_the_family_modules_ask_which_family_they_hold():
    package = ROOT / "utils" / "calculator"
    asking = re.compile(r"\.arch\s*(==|!=|\bin\b|\bnot in\b)|\bis_hf\b|arch\s*==")
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if "families" in path.parts or path.name == "registry.py":   # the families, and where they are kept
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if asking.search(code) and "def is_hf" not in code and '"""' not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "the engine asks which family it holds:\n" + "\n".join(offenders)


def test_a_family_is_one_module_and_registered_by_name():
    families = registry.families()
    assert {f.arch for f in families} >= {"gpt", "llama", "hf-llama", "hf-qwen3", "hf-phi3", "hf-gemma2", "hf-gemma3",
                                          "hf-gpt2"}
    for family in families:
        assert Path(inspect.getfile(type(family))).parent.name == "families"
        assert registry.family_of(family.arch) is family
    with pytest.raises(ValueError, match="model_type 'gemma3' is not modelled.*text_config"):
        C.model_config_from_hf({"model_type": "gemma3", "text_config": {}})
