"""Upstream lingbot-map weights into ``LingbotMap``, by name, all or nothing.

Reads upstream's torch checkpoint (``{"model": state_dict}`` or a bare state dict; torch
is needed only for this) or a safetensors file (upstream names; what ``convert`` writes,
with the config in its metadata, readable without torch), told apart by their first
bytes; any other file is refused saying what it is.

Names: a parameter's path in the NNX model, joined by dots, is upstream's key, except
* Linear ``kernel`` / LayerNorm ``scale`` -> ``weight`` (Linear kernels transposed, conv
  kernels HWIO <-> OIHW);
* ``aggregator.patch_embed.patch_embed`` -> ``...patch_embed.proj``;
  ``camera_head.poseLN_modulation`` -> ``...poseLN_modulation.1`` (after a SiLU in a
  Sequential upstream); ``depth_head.resize_{0,1,3}`` -> ``...resize_layers.{0,1,3}``;
  ``scratch.output_conv2_{0,2}`` -> ``scratch.output_conv2.{0,2}``;
* tokens and embeddings drop upstream's leading singleton axes.

Keys upstream itself ignores (it loads non-strictly) are skipped, not errors:
``IGNORED`` (DINOv2's ``mask_token``: masked-image training only) and the weights of
heads the config does not build (upstream builds only enabled heads, so a checkpoint
trained with a point head loads into a model without one).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.models.lingbot.config import BACKBONES, LingbotConfig
from jaxkv.models.lingbot.model import LingbotMap

IGNORED = ("aggregator.patch_embed.mask_token",)
HEADS = {
    "camera_head": "enable_camera",
    "depth_head": "enable_depth",
    "point_head": "enable_point",
    "local_point_head": None,
    "track_head": None,
}
RENAMES = (
    (r"^aggregator\.patch_embed\.patch_embed\.", "aggregator.patch_embed.patch_embed.proj."),
    (r"^camera_head\.poseLN_modulation\.", "camera_head.poseLN_modulation.1."),
    (r"\.resize_(\d)\.", r".resize_layers.\1."),
    (r"\.output_conv2_(\d)\.", r".output_conv2.\1."),
)
FORMAT = "jaxkv-lingbot"


def upstream_key(path: tuple) -> str:
    """The upstream state-dict key of the NNX parameter at ``path``."""
    *head, last = (str(p) for p in path)
    name = ".".join(head) + "." + {"kernel": "weight", "scale": "weight"}.get(last, last)
    for pat, rep in RENAMES:
        name = re.sub(pat, rep, name)
    return name


def to_upstream(path: tuple, x: np.ndarray) -> np.ndarray:
    """An NNX parameter in upstream's layout (the inverse of ``from_upstream``)."""
    name = str(path[-1])
    if name == "kernel":
        return x.T if x.ndim == 2 else np.transpose(x, (3, 2, 0, 1))
    if name in ("cls_token", "empty_pose_tokens"):
        return x.reshape(1, 1, -1)
    if name.endswith(("token", "tokens")) or name == "pos_embed":
        return x[None]
    return x


def from_upstream(path: tuple, x: np.ndarray, shape: tuple) -> np.ndarray | None:
    """Upstream's tensor in the NNX layout of ``shape``, or None when it cannot fit."""
    if path[-1] == "kernel":
        x = x.T if x.ndim == 2 else (np.transpose(x, (2, 3, 1, 0)) if x.ndim == 4 else x)
    elif (
        x.shape != shape
        and x.size == int(np.prod(shape))
        and tuple(d for d in x.shape if d != 1) == tuple(d for d in shape if d != 1)
    ):
        x = x.reshape(shape)  # tokens: upstream keeps leading singleton axes
    return x if x.shape == shape else None


EXPECTED = (
    "expected a safetensors file (convert-lingbot's output) or upstream's torch checkpoint "
    "(.pt / .pth, read with torch)"
)
# first bytes -> what a file that is not a checkpoint is, for the error message
MAGIC = (
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x89HDF", "an HDF5 file"),
    (b"GGUF", "a GGUF file (llama.cpp)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"version https://git-lfs", "a Git LFS pointer, not the weights (fetch them: git lfs pull)"),
    (b"<", "a text file (HTML or XML: an error page saved instead of the download?)"),
    (b"{", "a text file (JSON)"),
)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_HEADER_MAX = 100 * 2**20  # the safetensors format's own bound on its JSON header


def checkpoint_kind(path, *, arg: str = "path") -> str:
    """``"safetensors"`` or ``"torch"``: what the file at ``path`` is, from its first bytes
    (its name only where they match nothing known: a ``.pt`` is left to ``torch.load``). A
    ValueError naming ``arg`` for anything else, saying what the file is: missing, a folder,
    empty, a truncated or corrupted safetensors file, an image, a Git LFS pointer, ..."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{arg}: no checkpoint file at {path}")
    if path.is_dir():
        raise ValueError(f"{arg}: {path} is a folder; {EXPECTED}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{arg}: {path} is empty (0 bytes); {EXPECTED}")
    with open(path, "rb") as f:
        head = f.read(32)
        if head.startswith(b"PK\x03\x04"):
            return "torch"  # a zip archive: torch.save's format (torch.load says if it is not one)
        if head[:1] == b"\x80" and head[1:2] and 2 <= head[1] <= 5:
            return "torch"  # a bare pickle: torch.save's legacy format
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if head[8:9] == b"{" and 2 <= n <= SAFETENSORS_HEADER_MAX:
            f.seek(8)
            why = (
                f"its header needs {n} bytes, the file has {size}"
                if 8 + n > size
                else _safetensors_problem(f.read(n), size - 8 - n)
            )
            if why:
                raise ValueError(f"{arg}: {path} is not a valid safetensors file ({why}): truncated or corrupted?")
            return "safetensors"
    what = next((name for magic, name in MAGIC if head.lstrip().startswith(magic)), None)
    if what is None and path.suffix == ".safetensors":
        why = f"its header length field says {n} bytes" + (f", the file has {size}" if 8 + n > size else "")
        raise ValueError(f"{arg}: {path} is not a valid safetensors file ({why}): truncated or corrupted?")
    if what is None and path.suffix.lower() in TORCH_SUFFIXES:
        return "torch"  # by its name; torch.load says if it is not one
    what = what or f"not a format jaxkv reads (it starts with bytes {head[:8].hex(' ')})"
    raise ValueError(f"{arg}: {path} ({path.suffix or 'no suffix'}, {size} bytes) is {what}; {EXPECTED}")


def _safetensors_problem(header: bytes, data_bytes: int) -> str | None:
    """Why a safetensors JSON header (and ``data_bytes`` after it) cannot be read, or None."""
    try:
        entries = json.loads(header)
    except (ValueError, UnicodeDecodeError) as e:
        return f"its header is not JSON: {e}"
    if not isinstance(entries, dict):
        return "its header is not a JSON object"
    end = 0
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {name!r} has no data_offsets"
        end = max(end, offsets[1])
    if end > data_bytes:
        return f"its tensors need {end} bytes of data, the file holds {data_bytes}"
    return None


def _first_line(e: Exception, width: int = 160) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def read_state_dict(path, *, unsafe_pickle: bool = False, arg: str = "path") -> tuple[dict, dict]:
    """(``{key: f32 ndarray}``, safetensors metadata or {}) from a safetensors file or a torch
    checkpoint (``.pt`` / ``.pth`` / ``.bin``), told apart by their bytes (``checkpoint_kind``).
    ValueErrors name ``arg``."""
    path = Path(path)
    if checkpoint_kind(path, arg=arg) == "safetensors":
        try:
            from safetensors import safe_open
        except ImportError:
            raise ValueError(
                f'{arg}: reading {path.name} needs safetensors, not installed here: pip install "jaxkv[lingbot]"'
            ) from None
        try:
            with safe_open(str(path), framework="flax") as f:
                meta = f.metadata() or {}
                sd = {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError and the dtype errors under it
            raise ValueError(f"{arg}: {path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
        return sd, meta
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"{arg}: {path.name} is a torch checkpoint; reading it needs torch, not installed here: "
            'pip install "jaxkv[torch]", or convert it once where torch is installed: '
            "python -m jaxkv convert-lingbot"
        ) from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=not unsafe_pickle)
    except Exception as e:  # noqa: BLE001 - torch raises several types for a pickle it will not load
        raise ValueError(
            f"{arg}: torch.load({path.name}, weights_only={not unsafe_pickle}) failed "
            f"({type(e).__name__}: {_first_line(e)})"
            + ("; if you trust the file, pass unsafe_pickle=True" if not unsafe_pickle else "")
        ) from None
    sd = obj.get("model", obj) if isinstance(obj, dict) else None
    if not isinstance(sd, dict) or not all(hasattr(v, "shape") for v in sd.values()):
        raise ValueError(f"{arg}: {path.name} holds neither a state dict nor {{'model': state dict}}")
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return {k: v.detach().float().cpu().numpy() for k, v in sd.items()}, {}


def config_from_state_dict(sd: dict, **overrides) -> LingbotConfig:
    """The architecture a state dict holds (backbone, patch and trained image size, depth,
    registers), with ``overrides`` for everything else (frame size, cache policy, dtype)."""

    def need(key):
        if key not in sd:
            raise ValueError(f"state dict: missing {key!r}: not a lingbot-map GCTStream checkpoint")
        return sd[key]

    proj = need("aggregator.patch_embed.patch_embed.proj.weight")
    dim, patch = proj.shape[0], proj.shape[-1]
    backbone = next((n for n, (d, *_) in BACKBONES.items() if d == dim), None)
    if backbone is None:
        raise ValueError(f"state dict: a {dim}-wide backbone; this port has {sorted(BACKBONES)}")
    side = int(round((need("aggregator.patch_embed.pos_embed").shape[1] - 1) ** 0.5))
    depth = 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("aggregator.frame_blocks."))
    found = dict(
        patch_embed=backbone,
        patch_size=int(patch),
        img_size=side * int(patch),
        depth=depth,
        num_register_tokens=int(need("aggregator.register_token").shape[2]),
        enable_3d_rope=dim // LingbotConfig.num_heads == 64,
    )  # upstream's 3D RoPE needs 64-dim heads
    if "height" not in overrides and "width" not in overrides:
        found.update(height=side * int(patch), width=side * int(patch))
    return LingbotConfig(**{**found, **overrides})


def load_state_dict(model: LingbotMap, sd: dict) -> list[str]:
    """Put ``sd`` (upstream keys) into ``model``'s parameters: all of them or none.

    Returns the keys skipped because upstream ignores them too (see the module doc).
    Raises ValueError listing every missing, unexpected and mis-shaped key.
    """
    c = model.config
    params = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(params))
    want = {upstream_key(p): p for p in flat}
    ignored = [
        k
        for k in sd
        if k in IGNORED
        or (k.split(".")[0] in HEADS and k not in want and not getattr(c, HEADS[k.split(".")[0]] or "", False))
    ]
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(set(sd) - set(want) - set(ignored))
    new, misshaped = {}, []
    for key, path in want.items():
        if key in sd:
            shape = tuple(flat[path].get_value().shape)
            x = from_upstream(path, sd[key], shape)
            if x is None:
                misshaped.append(f"{key}: checkpoint {tuple(sd[key].shape)}, model {shape}")
            else:
                new[path] = x
    if missing or unexpected or misshaped:
        lines = [
            f"{len(missing)} missing: {missing}" if missing else "",
            f"{len(unexpected)} unexpected: {unexpected}" if unexpected else "",
            f"{len(misshaped)} mis-shaped: {misshaped}" if misshaped else "",
        ]
        raise ValueError(
            "state dict does not fit LingbotMap("
            + _arch(c)
            + "); nothing was loaded. "
            + "; ".join(x for x in lines if x)
            + f". (Skipped as upstream does: {IGNORED[0]} and disabled heads' weights.)"
        )
    for path, x in new.items():
        flat[path].set_value(jnp.asarray(x, flat[path].get_value().dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    return sorted(ignored)


def _arch(c: LingbotConfig) -> str:
    return (
        f"patch_embed={c.patch_embed}, patch_size={c.patch_size}, img_size={c.img_size}, depth={c.depth}, "
        f"point head={'on' if c.enable_point else 'off'}"
    )


def checkpoint_config(sd: dict, meta: dict, **overrides) -> LingbotConfig:
    """The config of a checkpoint: the one ``convert`` saved in its metadata, else the
    architecture the state dict holds; ``overrides`` on top."""
    saved = {}
    if meta.get("format") == FORMAT:
        try:
            saved = json.loads(meta["config"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"state dict: its {FORMAT} metadata holds no readable config ({e})") from None
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(LingbotConfig)})
        if unknown:
            raise ValueError(
                f"state dict: its saved config has fields {unknown} that this jaxkv's LingbotConfig "
                "does not know (written by a newer jaxkv?)"
            )
    saved["selected_idx"] = tuple(saved.get("selected_idx", LingbotConfig.selected_idx))
    return config_from_state_dict(sd, **{**saved, **overrides})


def model_from_state_dict(config: LingbotConfig, sd: dict, *, arg: str = "path") -> LingbotMap:
    """``from_state_dict``'s model, warning about the keys skipped as upstream skips them;
    a state dict that does not fit raises a ValueError naming ``arg``."""
    try:
        model, skipped = from_state_dict(config, sd)
    except ValueError as e:
        raise ValueError(f"{arg}: {e}") from None
    if skipped:
        warnings.warn(
            f"{len(skipped)} checkpoint keys skipped, as upstream skips them: {skipped[:6]}"
            + (" ..." if len(skipped) > 6 else ""),
            stacklevel=3,
        )
    return model


def load_lingbot_checkpoint(
    path, config: LingbotConfig | None = None, *, unsafe_pickle: bool = False, arg: str = "path", **overrides
) -> LingbotMap:
    """A ``LingbotMap`` with upstream's weights from ``path`` (``.pt`` / ``.safetensors``).

    config: the model to build; None infers the architecture from the checkpoint (and
      takes the config saved by ``convert``), ``overrides`` set the rest (height, width,
      cache policy, dtype, ...).
    arg: the name ValueErrors give the checkpoint (a CLI passes its flag).
    """
    sd, meta = read_state_dict(path, unsafe_pickle=unsafe_pickle, arg=arg)
    if config is None:
        config = checkpoint_config(sd, meta, **overrides)
    elif overrides:
        config = config.replace(**overrides)
    return model_from_state_dict(config, sd, arg=arg)


def from_state_dict(config: LingbotConfig, sd: dict) -> tuple[LingbotMap, list[str]]:
    """``LingbotMap(config)`` holding ``sd`` (upstream keys), built without a random init
    (which costs longer than the load for the 1.16 B-parameter model). Returns the model and
    the keys skipped as upstream skips them; raises as ``load_state_dict``."""
    model = _materialize(nnx.eval_shape(lambda: LingbotMap(config, rngs=_FixedKey())))
    return model, load_state_dict(model, sd)


class _FixedKey:
    """Stands in for ``nnx.Rngs`` when every parameter is overwritten: one key and no counter.
    (Tracing ``nnx.Rngs``' counter under ``eval_shape`` costs time quadratic in the model's
    size in flax 0.12 — minutes for the released model.)"""

    def __init__(self):
        self.key = jax.random.key(0)

    def __call__(self):
        return self.key

    def __getattr__(self, stream):  # rngs.params(), rngs.dropout(), ...
        if stream.startswith("__"):
            raise AttributeError(stream)
        return self


def _materialize(abstract: LingbotMap) -> LingbotMap:
    """An ``nnx.eval_shape`` model with real caches; its parameters stay abstract until
    ``load_state_dict`` sets every one of them (or raises, and the model is dropped)."""
    gdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest)
    real = nnx.merge(gdef, params, rest)
    real.reset()  # the caches' token ids and trash rows are not zeros
    return real


def save_converted(model: LingbotMap, out, config: LingbotConfig | None = None) -> Path:
    """Write ``model``'s parameters as safetensors (upstream names, float32) with its config
    (or ``config``): ``load_lingbot_checkpoint(out)`` reads it back without torch."""
    from safetensors.numpy import save_file

    out = Path(out)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {
        upstream_key(p): np.ascontiguousarray(to_upstream(p, np.asarray(v.get_value(), np.float32)))
        for p, v in flat.items()
    }
    cfg = dataclasses.asdict(config or model.config)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "config": json.dumps(cfg)})
    tmp.replace(out)
    return out


def convert(src, out, *, arg: str = "src", **overrides) -> Path:
    """``python -m jaxkv convert-lingbot SRC OUT``: upstream's checkpoint as a torch-free safetensors file.
    ValueErrors about the checkpoint name ``arg``."""
    model = load_lingbot_checkpoint(src, arg=arg, **{**overrides, "dtype": "float32"})  # bf16 weights would round
    return save_converted(model, out, model.config.replace(dtype=overrides.get("dtype", LingbotConfig.dtype)))
