"""The model families the calculator replays, one module each, registered by name when imported.

* ``course_gpt.py``, ``course_llama.py``: the course's own designs (``utils.TinyTransformer``, ``llama_like``);
* ``llama.py``: transformers' Llama, Mistral and Qwen2; ``qwen3.py``; ``phi3.py``; ``gemma2.py``; ``gemma3.py``
  (Gemma 3's language model); ``gpt2.py``;
* ``base.py``: the protocol (``Family``) and how a config is read field by field (``FieldRules``);
  ``decoder.py``: the transformers causal-LM skeleton most of them share; ``hf_modules.py``: transformers' shared
  modules (norms, rotary, masks, attention, dropout, peft's LoRA) as replay functions; ``course.py``: what the
  course's two designs share.
"""

from . import (course_gpt, course_llama, gemma2, gemma3, gpt2, llama, mixtral, olmoe, phi3, qwen3,  # noqa: F401
               qwen3_moe)  # each registers itself
