"""Models: one decoder for every decoder family (GPT-NeoX/Pythia, Llama 2/3, Qwen2/3, Mistral,
OLMo 2, Phi-3, Gemma 2/3, GPT-2, GPT-J), and BERT."""

from lmforge.models.build import as_config, build, init_weights, num_parameters
from lmforge.models.config import ModelConfig
from lmforge.models.decoder import Decoder
from lmforge.models.encoder import Bert
from lmforge.models.presets import PRESETS, preset
from lmforge.models.source import load_pretrained

__all__ = [
    "PRESETS",
    "Bert",
    "Decoder",
    "ModelConfig",
    "as_config",
    "build",
    "init_weights",
    "load_pretrained",
    "num_parameters",
    "preset",
]
