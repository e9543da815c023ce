"""The language model families are described in: ``Param`` rules, ``Family`` and ``HfConfig``.

``families.py`` describes each family in it, ``hf_layout.py`` interprets the descriptions and
``model.py`` reads them to check a ModelConfig (``Family.moe``). This module imports none of
them at run time (``ModelConfig`` appears in annotations only), so each can import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember_megatron_backend.model import ModelConfig

__all__ = ["COMMON_FIELDS", "Family", "HfConfig", "Param", "p", "swiglu"]


@dataclass(frozen=True, slots=True)
class Param:
    """One Megatron parameter and the checkpoint tensors it is made of.

    Names are relative: in a layer rule to ``decoder.layers.{i}.`` (Megatron) and
    ``model.layers.{i}.`` (checkpoint); in an expert rule ``{e}`` is the expert index.
    """

    megatron: str
    """Megatron name (relative)."""
    hf: tuple[str, ...]
    """Checkpoint names (relative), in the order the layout merges them."""
    layout: str = "same"
    """How the checkpoint tensors make the Megatron one: "same", "qkv" or "glu"."""
    when: str = ""
    """A ModelConfig attribute the parameter exists under (truthy), "!attr" for falsy; empty
    for always."""

    def applies(self, cfg: ModelConfig) -> bool:
        """Whether `cfg` has this parameter."""
        if not self.when:
            return True
        negate = self.when.startswith("!")
        value = bool(getattr(cfg, self.when.lstrip("!")))
        return value != negate


def p(megatron: str, *hf: str, layout: str = "same", when: str = "") -> Param:
    """Shorthand for a ``Param``."""
    return Param(megatron, hf, layout, when)


def swiglu(
    megatron: str,
    hf: str,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    when: str = "",
) -> tuple[Param, Param]:
    """The two parameters of a SwiGLU MLP at Megatron prefix `megatron` and checkpoint prefix
    `hf` (the checkpoint's projection names may differ, as Mixtral's w1/w3/w2)."""
    return (
        p(
            f"{megatron}.linear_fc1.weight",
            f"{hf}.{gate}.weight",
            f"{hf}.{up}.weight",
            layout="glu",
            when=when,
        ),
        p(f"{megatron}.linear_fc2.weight", f"{hf}.{down}.weight", when=when),
    )


@dataclass(frozen=True, slots=True)
class HfConfig:
    """How a family's transformers config reads and writes a ModelConfig."""

    config_class: str
    """transformers config class."""
    architecture: str
    """transformers model class, recorded in config.json ``architectures``."""
    fields: tuple[tuple[str, str], ...]
    """(ModelConfig field, HF config attribute) pairs copied both ways."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """HF attributes this family's models always have: written on export; on import an other
    value is refused (the message names the attribute)."""
    fixed_model: dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields every model of the family has (set on import, checked on export)."""
    to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    """Further HF attributes computed from the ModelConfig (the ones not 1:1)."""
    from_hf: Callable[[Any], dict[str, Any]] | None = None
    """Further ModelConfig fields computed from the HF config; raises ValueError for what the
    backend does not build."""


@dataclass(frozen=True, slots=True)
class Family:
    """A model family: its checkpoint names per layer site and its config mapping."""

    model_type: str
    """transformers ``model_type`` (= ``ModelConfig.family``)."""
    attention: tuple[Param, ...]
    """Attention and the layer's norms (every layer)."""
    dense_mlp: tuple[Param, ...]
    """The MLP of a dense layer."""
    router: tuple[Param, ...] = ()
    """The router of an MoE layer."""
    expert: tuple[Param, ...] = ()
    """One routed expert (``{e}``)."""
    shared: tuple[Param, ...] = ()
    """The shared expert(s) of an MoE layer, and their gate."""
    hf: HfConfig | None = None
    """The transformers config mapping."""
    expert_fused: tuple[str, str] | None = None
    """transformers 5's in-memory names of a layer's fused experts (gate_up [E, 2I, H], down
    [E, H, I]), relative to the layer, where its checkpoint stores one tensor per expert."""
    memory_renames: tuple[tuple[str, str], ...] = ()
    """(checkpoint, in-memory) name fragments where transformers renames on load."""
    sglang_ties: bool = True
    """Whether SGLang 0.5.23's model class of this family shares its output layer with the
    embedding when the config says `tie_word_embeddings`. Where it does not, a tied model's
    output layer would never be loaded there (Ember exports and pushes no `lm_head` for a tied
    model), so `BackendConfig.check_sglang_ties` refuses that combination."""

    def in_memory(self, name: str) -> str:
        """The transformers in-memory name of checkpoint tensor `name` (experts aside)."""
        for old, new in self.memory_renames:
            name = name.replace(old, new)
        return name

    @property
    def moe(self) -> bool:
        """Whether the family's MLPs are routed experts: its description has a router (a dense
        family describes no router, and its models have ``num_experts=0``)."""
        return bool(self.router)


COMMON_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_attention_heads", "num_attention_heads"),
    ("norm_epsilon", "rms_norm_eps"),
    ("max_position_embeddings", "max_position_embeddings"),
    ("tie_word_embeddings", "tie_word_embeddings"),
    ("init_method_std", "initializer_range"),
)
"""(ModelConfig field, HF config attribute) pairs every family's config names alike."""
