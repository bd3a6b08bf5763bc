"""config.json's rotary fields <-> ModelConfig (rotary_base, rotary_pct, rope_scaling), both
transformers layouts.

transformers 5 writes one `rope_parameters` dict (rope_type, rope_theta, partial_rotary_factor and
the scaling's own fields); 4.x wrote a top-level rope_theta / partial_rotary_factor and a
`rope_scaling` dict whose kind may sit under "type". Reading accepts both; writing gives both, so
either version loads the export.
"""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ROPE_SCALINGS, ModelConfig, RopeScaling

_SCALING_FIELDS = (
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "short_factor",
    "long_factor",
)


def rope_from_hf(
    hf: dict, params: dict | None = None, default_theta: float = 10000.0
) -> tuple[float, float, RopeScaling | None]:
    """(rotary_base, rotary_pct, rope_scaling) of config.json `hf`; `params`: one layer type's own
    rope_parameters where a family nests them by layer type (Gemma 3)."""
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    # Phi-3's names for longrope before 4.44
    if kind in ("su", "yarn") and hf.get("model_type") == "phi3":
        kind = "longrope"
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    pct = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if kind == "default":
        return theta, pct, None
    if kind not in ROPE_SCALINGS:
        raise UserError(
            f"rope scaling '{kind}' in config.json is not supported: lmforge implements default, "
            f"{', '.join(ROPE_SCALINGS)}"
        )
    fields = {k: params[k] for k in _SCALING_FIELDS if params.get(k) is not None}
    # Phi-3's top-level value comes first
    if kind == "longrope" and hf.get("original_max_position_embeddings"):
        fields["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    # transformers' fallback: the top-level value, else the context
    if kind in ("llama3", "yarn", "longrope"):
        fields.setdefault(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings"),
        )
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        original = fields["original_max_position_embeddings"]
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise UserError(
                f"rope_scaling.original_max_position_embeddings: expected a positive integer, got "
                f"{original!r}"
            )
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise UserError(f"rope scaling '{kind}' in config.json has no factor")
    if isinstance(factor, int | float) and not isinstance(factor, bool):
        factor = float(factor)  # else RopeScaling names it
    return theta, pct, RopeScaling(type=kind, factor=factor, **fields)


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers 5's rope_parameters for cfg's global rotary."""
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_pct != 1.0:
        rope["partial_rotary_factor"] = cfg.rotary_pct
    if cfg.rope_scaling is not None:
        rope.update(_scaling(cfg))
    return rope


def _scaling(cfg: ModelConfig) -> dict:
    s = cfg.rope_scaling
    return {
        "rope_type": s.type,
        "factor": s.factor,
        **{k: getattr(s, k) for k in _SCALING_FIELDS if getattr(s, k) is not None},
    }


def rope_to_hf(cfg: ModelConfig) -> dict:
    """config.json's rotary fields: rope_parameters (transformers 5) and rope_theta /
    rope_scaling (4.x)."""
    scaling = _scaling(cfg) if cfg.rope_scaling is not None else None
    return {
        "rope_theta": cfg.rotary_base,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters(cfg),
    }
