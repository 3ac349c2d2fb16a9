"""llm-compressor recipes: read the kv_cache_scheme a user already has; refuse what the target cannot serve.

`<name>_stage` -> `<group>_modifiers` -> `<Modifier>` -> `kv_cache_scheme` (compressed-tensors `QuantizationArgs`).
Its `calculate_range` sizes every FP8 scale for 448 and `QuantizationArgs` forbids extra fields, so the chip goes in
a top-level key llm-compressor ignores (`kvcalib: {target: trn2}`); kvcalib applies that FP8 max itself."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kvcalib.core import fp8
from kvcalib.core.errors import MissingDependencyError, RecipeError, UsageError
from kvcalib.core.paths import require_regular_file
from kvcalib.core.schema import (
    ATTN_HEAD,
    NEURON_PER_HEAD_REASON,
    TENSOR,
    fp8_attention_groups,
    parse_kv_scheme,
)

__all__ = [
    "KvRecipe",
    "LLMCOMPRESSOR_ENGINE",
    "RecipePlan",
    "load_recipe",
    "plan_recipe",
    "recipe_file",
    "require_llmcompressor",
]

RECIPE_KEY = "kvcalib"  # the top-level key with kvcalib's own settings

KV_SCHEME_KEY = "kv_cache_scheme"
OTHER_SCHEME_KEYS = (
    "scheme",
    "config_groups",
)  # a modifier's arguments that quantise something else
NATIVE_OBSERVER = "static_minmax"  # what the native engine measures: the absmax over every token
# llm-compressor 0.14's K/V observer when a kv_cache_scheme names none (a moving average of per-batch ranges that
# ends below the absmax): llmcompressor/modifiers/quantization/calibration.py, initialize_observer
LLMCOMPRESSOR_DEFAULT_OBSERVER = "minmax"
LLMCOMPRESSOR_ENGINE = "llmcompressor"
LLMCOMPRESSOR_HINT = "pip install kvcalib[llmcompressor]"
_SHIPPED = "(recipes/kv-fp8-trn2.yaml; --recipe trn2)"
_SEE_SHIPPED = f"see the shipped recipe {_SHIPPED}"


@dataclass(frozen=True)
class KvRecipe:
    """The KV-cache part of an llm-compressor recipe."""

    path: str
    location: (
        str  # where the kv_cache_scheme sits, e.g. quant_stage.quant_modifiers.QuantizationModifier
    )
    scheme: dict[str, Any]  # the kv_cache_scheme as compressed-tensors dumps it (JSON types)
    target: str | None  # the recipe's kvcalib.target, if it names one
    ignored: tuple[str, ...] = ()  # modifiers (or their parts) that quantise something else
    attention: bool = (
        False  # an FP8-attention config group: Q scales too (calibrate --attention-scales)
    )

    @property
    def observer(self) -> str | None:
        return self.scheme.get("observer")


@dataclass(frozen=True)
class RecipePlan:
    """--recipe, --target and --engine checked together, before any weight is loaded."""

    target: str  # the target name to calibrate for (not yet checked against fp8.TARGETS)
    recipe: KvRecipe | None
    observer: str  # what the engine will run
    strategy: str = TENSOR  # tensor or attn_head: --strategy, else the recipe's kv_cache_scheme
    attention_scales: bool = False  # the recipe has llm-compressor's FP8-attention group
    warnings: tuple[str, ...] = ()
    provenance: dict[str, Any] = field(default_factory=dict)


def builtin_recipes() -> Path:
    """The shipped recipes: kvcalib.recipes when installed, else the source tree's recipes/."""
    spec = importlib.util.find_spec("kvcalib.recipes")  # a folder of YAML: a namespace package
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parents[2] / "recipes"


# The recipes kvcalib ships (recipes/, installed as kvcalib.recipes), by name: one per chip of the table.
BUILTIN_RECIPES = tuple(
    name for name in fp8.TARGETS if (builtin_recipes() / f"kv-fp8-{name}.yaml").is_file()
)


def recipe_file(recipe: str | Path) -> Path:
    """`--recipe`: a shipped recipe by name (kv-fp8-NAME.yaml) or a file's path; an existing file of that name wins."""
    text = str(recipe)
    if text in BUILTIN_RECIPES and not Path(text).exists():
        return builtin_recipes() / f"kv-fp8-{text}.yaml"
    return Path(text).expanduser()


def load_recipe(path: str | Path) -> KvRecipe:
    """The kv_cache_scheme (and kvcalib's target) of a recipe file or a shipped recipe by name (`recipe_file`)."""
    import yaml

    path = recipe_file(path)
    recipe_path = require_regular_file(
        path,
        "recipe",
        error=RecipeError,
        missing=RecipeError,
        hint="pass a recipe file, or a shipped recipe by name: " + ", ".join(BUILTIN_RECIPES),
    )
    try:
        obj = yaml.safe_load(recipe_path.read_text(encoding="utf-8"))  # JSON is YAML too
    except OSError as exc:
        raise RecipeError(
            f"cannot read recipe {path}: {exc.strerror or exc}", hint="check the file's permissions"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(
            f"{path}: not a YAML or JSON recipe ({first})",
            hint="fix the YAML, or start from the shipped one: --recipe trn2",
        ) from None
    if not isinstance(obj, dict):
        raise RecipeError(
            f"{path}: a recipe is a mapping of `<name>_stage` sections, not {type(obj).__name__}",
            hint=_SEE_SHIPPED,
        )
    settings, target = obj.get(RECIPE_KEY), None
    if settings is not None:
        if not isinstance(settings, dict) or set(settings) - {"target"}:
            raise RecipeError(
                f"{path}: {RECIPE_KEY} must be a mapping with the key target only, not {settings!r}",
                hint=f"{RECIPE_KEY}: {{target: trn2}}",
            )
        target = settings.get("target")
        if target is not None and target not in fp8.TARGETS:
            raise RecipeError(
                f"{path}: {RECIPE_KEY}.target {target!r} is not a known target",
                hint=f"use one of {', '.join(sorted(fp8.TARGETS))}",
            )
    # (modifier location, field, scheme) for every kv_cache_scheme and FP8-attention group's input activations;
    # the modifiers (or their parts) that quantise something else
    found: list[tuple[str, str, Any]] = []
    ignored: list[str] = []
    modifiers = [
        (f"{stage_key}.{group_key}.{modifier}", {} if arguments is None else arguments)
        for stage_key, stage in obj.items()
        if str(stage_key).endswith("_stage") and isinstance(stage, dict)
        for group_key, group in stage.items()
        if str(group_key).endswith("_modifiers") and isinstance(group, dict)
        for modifier, arguments in group.items()
    ]
    for location, arguments in modifiers:
        if not isinstance(arguments, dict):
            raise RecipeError(
                f"{path}: {location} must be a mapping of arguments, not {arguments!r}",
                hint=f"see the shipped recipe for the layout {_SHIPPED}",
            )
        groups, scheme = arguments.get("config_groups"), arguments.get(KV_SCHEME_KEY)
        fp8_attention = fp8_attention_groups(groups)
        found += [
            (location, f"config_groups.{name}.input_activations", args)
            for name, args in fp8_attention.items()
        ]
        found += [(location, KV_SCHEME_KEY, scheme)] if scheme is not None else []
        others = [
            key
            for key in OTHER_SCHEME_KEYS
            if arguments.get(key)
            and not (key == "config_groups" and len(fp8_attention) == len(groups))
        ]
        if scheme is None and not fp8_attention:
            ignored.append(location)
        elif others:
            ignored.append(f"{location} ({', '.join(others)})")
    if not found:
        raise RecipeError(
            f"{path}: no {KV_SCHEME_KEY} in the recipe",
            hint=f"kvcalib reads <name>_stage: <group>_modifiers: QuantizationModifier: {KV_SCHEME_KEY} "
            f"(or an FP8-attention config group); {_SEE_SHIPPED}",
        )
    parsed = []  # through compressed-tensors' QuantizationArgs, as JSON types; the observer as written
    for location, key, value in found:
        where = f"{path}: {location}.{key}"
        if not isinstance(value, dict):
            raise RecipeError(
                f"{where} must be a mapping (num_bits, type, strategy, ...), not {value!r}",
                hint=_SEE_SHIPPED,
            )
        try:
            parsed.append((location, parse_kv_scheme(value).model_dump(mode="json")))
        except ValueError as exc:
            raise RecipeError(
                f"{where} is not a valid compressed-tensors QuantizationArgs: {exc}",
                hint=_SEE_SHIPPED,
            ) from None
    if len({json.dumps(scheme, sort_keys=True) for _, scheme in parsed}) > 1:
        places = ", ".join(
            f"{location}.{field}" if field != KV_SCHEME_KEY else location
            for location, field, _ in found
        )
        raise RecipeError(
            f"{path}: {len(parsed)} different {KV_SCHEME_KEY} entries ({places})",
            hint="keep one kv_cache_scheme; the KV cache has one format (an FP8-attention group "
            "quantises K/V with its own input_activations)",
        )
    location, scheme = parsed[0]
    attention = any(field != KV_SCHEME_KEY for _, field, _ in found)
    return KvRecipe(str(path), location, scheme, target, tuple(ignored), attention)


def check_servable(recipe: KvRecipe, target: fp8.Target) -> None:
    """Refuse a kv_cache_scheme that vLLM on `target` cannot serve from kvcalib's checkpoint."""
    s, chip = recipe.scheme, target.name
    example = f"recipes/kv-fp8-{chip}.yaml (--recipe {chip})"
    refusals = (  # (refused, what the scheme has and why the chip cannot serve it, the fix), the first one reported
        (
            s["type"] != "float",
            f"type {s['type']!r} ({s['num_bits']}-bit integer KV), which {chip} cannot serve: "
            "vLLM keeps an FP8 KV cache (type float, num_bits 8); compressed-tensors reads a missing type as int",
            f"set type: float and num_bits: 8, as in {example}",
        ),
        (
            s["num_bits"] != 8,
            f"num_bits {s['num_bits']}, which {chip} cannot serve: vLLM's KV cache is FP8 "
            "(num_bits 8)",
            f"set num_bits: 8, as in {example}",
        ),
        (
            s["dynamic"] is not False,
            f"dynamic: {s['dynamic']!r}, which {chip} cannot serve: vLLM reads static "
            "per-layer KV scales from the checkpoint",
            f"set dynamic: false, as in {example}",
        ),
        (
            s["strategy"] == ATTN_HEAD and target.neuron,
            f"strategy attn_head (one scale per KV head), which {chip} "
            f"cannot serve: {NEURON_PER_HEAD_REASON}",
            f"set strategy: tensor, as in {example}",
        ),
        (
            s["strategy"] not in (TENSOR, ATTN_HEAD),
            f"strategy {s['strategy']!r}, which is no KV-cache strategy {chip} serves",
            f"set strategy: tensor, as in {example}",
        ),
        (
            s["symmetric"] is not True,
            f"symmetric: false (a zero point), which {chip} cannot serve: vLLM's FP8 KV "
            "cache is symmetric (x = fp8 * scale)",
            "set symmetric: true",
        ),
    )
    for refused, has, hint in refusals:
        if refused:
            raise RecipeError(
                f"{recipe.path}: {recipe.location}.{KV_SCHEME_KEY} has {has}", hint=hint
            )


def plan_recipe(
    recipe_path: str | Path | None, target: str | None, engine: str, strategy: str | None = None
) -> RecipePlan:
    """Read the recipe (if any), settle the target and the strategy, and check the scheme and engine can work."""
    recipe = load_recipe(recipe_path) if recipe_path is not None else None
    if recipe is not None and target is not None and recipe.target not in (None, target):
        raise RecipeError(
            f"--target {target} contradicts {recipe.path}, which is for {recipe.target} "
            f"({RECIPE_KEY}.target)",
            hint=f"drop --target, or use --recipe {target}",
        )
    chosen = target or (recipe.target if recipe else None) or fp8.DEFAULT_TARGET
    known, warnings = fp8.TARGETS.get(chosen), []  # an unknown name: the caller reports it
    if recipe is not None:
        if known is not None:
            check_servable(recipe, known)
        if recipe.ignored:
            warnings.append(
                f"{recipe.path}: kvcalib runs the {KV_SCHEME_KEY} only and ignores "
                f"{', '.join(recipe.ignored)}"
            )
    from_recipe = recipe.scheme.get("strategy") if recipe is not None else None
    if strategy is not None and from_recipe is not None and strategy != from_recipe:
        raise RecipeError(
            f"--strategy {strategy} contradicts {recipe.path}, whose {KV_SCHEME_KEY} has strategy "
            f"{from_recipe}",
            hint="drop --strategy, or change the recipe",
        )
    strategy = strategy or from_recipe or TENSOR
    if strategy == ATTN_HEAD and known is not None and known.neuron:
        raise UsageError(
            f"--strategy attn_head (one scale per KV head) cannot serve on {chosen}: "
            f"{NEURON_PER_HEAD_REASON}",
            hint="use --strategy tensor for Neuron; per-head scales are for "
            "--target gpu (vLLM's FlashAttention backend)",
        )
    if (
        engine == LLMCOMPRESSOR_ENGINE
    ):  # installed? check_run asks, after what the flags cannot do together
        observer = (
            recipe.observer if recipe else NATIVE_OBSERVER
        ) or LLMCOMPRESSOR_DEFAULT_OBSERVER
    else:
        observer = NATIVE_OBSERVER
        if recipe is not None and recipe.observer != NATIVE_OBSERVER:
            named = (
                f"observer {recipe.observer!r}"
                if recipe.observer
                else f"no observer (llm-compressor would run {LLMCOMPRESSOR_DEFAULT_OBSERVER!r})"
            )
            warnings.append(
                f"{recipe.path}: {named}; the native engine measures the absmax over every token "
                f"({NATIVE_OBSERVER}); --engine {LLMCOMPRESSOR_ENGINE} runs the recipe's observer"
            )
    return RecipePlan(
        chosen,
        recipe,
        observer,
        strategy,
        bool(recipe and recipe.attention),
        tuple(warnings),
        {
            "observer": observer,
            **({"recipe": recipe.path, "kv_cache_scheme": recipe.scheme} if recipe else {}),
        },
    )


def require_llmcompressor() -> str:
    """The installed llm-compressor's version; MissingDependencyError without it."""
    if importlib.util.find_spec("llmcompressor") is None:
        raise MissingDependencyError(
            f"--engine {LLMCOMPRESSOR_ENGINE} needs llm-compressor, which is not installed",
            hint=LLMCOMPRESSOR_HINT,
        )
    return version("llmcompressor")
