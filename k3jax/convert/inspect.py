"""``inspect PATH``: what a Hugging Face folder or a k3jax orbax checkpoint holds, from headers only.

Reads the config and the tensor headers (safetensors headers, orbax array metadata), never the
tensor data, and reports the config, total / active parameters (SPEC §11, counted from the stored
shapes: they equal ``k3jax.params.count_params`` for a complete checkpoint), dtypes, bytes per
component, quantisation, and every missing, unexpected or mis-shaped key.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from pathlib import Path

import numpy as np

from k3jax.config import LayerKind, ModelConfig
from k3jax.convert import orbax_ckpt as oc
from k3jax.convert.hf_config import family, from_hf_config
from k3jax.convert.hf_keys import KeyEntry, entries, ignored_prefixes
from k3jax.convert.hf_checks import check_tensor, expected_keys, mxfp4_keys, resolve
from k3jax.convert.orbax_layout import SCANNED, legacy_problem, stored_table, text_config
from k3jax.layout import scan_plan
from k3jax.convert.safetensors_io import SafetensorsReader
from k3jax.params import COMPONENTS, _component


@dataclasses.dataclass
class Report:
    path: str
    kind: str  # "Hugging Face" or "k3jax orbax"
    cfg: ModelConfig
    params: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    inactive: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    nbytes: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0))
    dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    quantisation: str = "none"
    layout: str = "per-layer"  # of the stored layers (k3jax.convert.orbax_layout); HF is per layer
    problems: list[str] = dataclasses.field(default_factory=list)
    vision: dict = dataclasses.field(default_factory=dict)  # {"vision_tower" | "mm_projector": parameters}
    vision_bytes: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.params.values()) + sum(self.vision.values())

    @property
    def active(self) -> int:
        """SPEC §11's active count, plus every tower and projector parameter (the tower is dense)."""
        return sum(self.params[c] - round(self.inactive[c]) for c in COMPONENTS) + sum(self.vision.values())

    def add_vision(self, entry, count: int, nbytes: int) -> None:
        part = entry.path[0]
        self.vision[part] = self.vision.get(part, 0) + count
        self.vision_bytes[part] = self.vision_bytes.get(part, 0) + nbytes

    def add(self, entry: KeyEntry, count: int, nbytes: int) -> None:
        """``count`` parameters of ``entry`` stored in ``nbytes`` (SPEC §11's active rule: the
        input embedding and the unused share of the routed experts are inactive)."""
        component = _component((entry.collection,) + entry.path, ("experts",) if entry.is_experts else None)
        self.params[component] += count
        self.nbytes[component] += nbytes
        if component == "embedding":
            self.inactive[component] += count
        elif entry.is_experts:
            m = self.cfg.moe
            self.inactive[component] += count * (m.num_experts - m.top_k) / m.num_experts


def _hf_entry(report: Report, reader: SafetensorsReader, entry: KeyEntry) -> None:
    keys = [entry.expert_key(e) for e in range(entry.shape[0])] if entry.is_experts else [entry.hf]
    count = int(np.prod(entry.shape[1:] if entry.is_experts else entry.shape))
    for key in keys:
        stored = [key] if key in reader else [k for k in mxfp4_keys(key) if k in reader]
        if not stored:
            continue  # reported as missing
        try:
            check_tensor(reader, key, entry.hf_shape)
        except ValueError as err:
            report.problems.append(f"mis-shaped: {err}")
            continue
        if key not in reader:
            report.quantisation = "routed experts MXFP4 (weight_packed + weight_scale, group 32)"
        for k in stored:
            report.dtypes[reader.infos[k].dtype.name] += 1
        report.add(entry, count, sum(reader.infos[k].end - reader.infos[k].begin for k in stored))


def inspect_hf(path: str) -> Report:
    cfg = from_hf_config(path)
    reader = SafetensorsReader(path)
    report = Report(path, "Hugging Face", cfg)
    table = [resolve(entry, reader) for entry in entries(cfg)]
    expected = expected_keys(table, reader)
    present = {k for k in reader.keys() if not k.startswith(ignored_prefixes(cfg))}
    report.problems += [f"missing: {k}" for k in sorted(expected - present)]
    report.problems += [f"unexpected: {k}" for k in sorted(present - expected)]
    for entry in table:
        _hf_entry(report, reader, entry)
    _hf_vision(report, path, reader)
    return report


def _hf_vision(report: Report, path: str, reader: SafetensorsReader) -> None:
    """The tower and projector of a multimodal folder: missing, unexpected and mis-shaped keys, counts."""
    from k3jax.vision.checkpoint import multimodal_config
    from k3jax.vision.hf_keys import VISION_PREFIXES, vision_entries

    try:
        mm = multimodal_config(path, report.cfg)
    except ValueError as err:
        report.problems.append(f"vision_config: {err}")
        return
    present = {k for k in reader.keys() if k.startswith(VISION_PREFIXES)}
    if mm is None or not present:  # no vision_config, or one kept without weights (a text-only release)
        return
    table = vision_entries(mm.vision, report.cfg.hidden)
    report.problems += [f"missing: {k}" for k in sorted({e.hf for e in table} - present)]
    report.problems += [f"unexpected: {k}" for k in sorted(present - {e.hf for e in table})]
    for entry in table:
        if entry.hf not in reader:
            continue
        info = reader.infos[entry.hf]
        if tuple(info.shape) != entry.hf_shape:
            report.problems.append(f"mis-shaped: {entry.hf!r} is {tuple(info.shape)}, expected {entry.hf_shape}")
            continue
        report.dtypes[info.dtype.name] += 1
        report.add_vision(entry, int(np.prod(entry.shape)), info.end - info.begin)


def inspect_orbax(path: str) -> Report:
    meta = oc.read_metadata(path)
    cfg = oc.checkpoint_config(meta)
    report = Report(path, "k3jax orbax", text_config(cfg), layout=meta["layout"])
    stored = oc.stored_leaves(Path(path))
    legacy = legacy_problem(stored, cfg, f"{path}/{oc.STATE}")
    report.problems += [legacy] if legacy else []
    want = {leaf.path: leaf for leaf in stored_table(cfg, meta["layout"])}
    report.problems += [f"missing: {'/'.join(p)}" for p in sorted(set(want) - set(stored))]
    report.problems += [f"unexpected: {'/'.join(p)}" for p in sorted(set(stored) - set(want))]
    for p, leaf in want.items():
        if p not in stored:
            continue
        shape, dtype = tuple(stored[p].shape), np.dtype(stored[p].dtype)
        if shape != leaf.shape:
            report.problems.append(f"mis-shaped: leaf {'/'.join(p)!r} is {shape}, expected {leaf.shape}")
            continue
        report.dtypes[dtype.name] += 1
        add = report.add_vision if leaf.is_vision else report.add
        add(leaf.entry, int(np.prod(shape)), int(np.prod(shape)) * dtype.itemsize)
    return report


def inspect(path: str) -> Report:
    """The report of a Hugging Face folder (``config.json``) or a k3jax orbax checkpoint folder."""
    if oc.is_orbax_checkpoint(path):
        return inspect_orbax(path)
    if (Path(path) / "config.json").is_file():
        return inspect_hf(path)
    raise ValueError(f"PATH={os.fspath(path)!r} must be a Hugging Face folder (config.json + safetensors) "
                     f"or a k3jax orbax checkpoint ({oc.METADATA} + {oc.STATE}/)")


def _config_lines(cfg: ModelConfig) -> list[str]:
    kinds = cfg.layer_kinds
    moe = cfg.moe
    latent = f", latent {moe.latent_dim}" if moe.latent_dim else ""
    return [f"family {family(cfg)}: vocab {cfg.vocab_size}, hidden {cfg.hidden}, {cfg.num_layers} layers "
            f"({kinds.count(LayerKind.KDA)} KDA, {kinds.count(LayerKind.MLA)} MLA, "
            f"{cfg.mlp.first_dense_layers} dense MLP first)",
            f"MoE: {moe.num_experts} experts, top-{moe.top_k}, {moe.num_shared_experts} shared, "
            f"width {moe.expert_intermediate}{latent}; AttnRes "
            f"{'block ' + str(cfg.attn_res.block_size) if cfg.attn_res else 'off'}; "
            f"parameter dtype {np.dtype(cfg.param_dtype).name}"]


def _layout_line(r: Report) -> str:
    if r.layout != SCANNED:
        return f"layout: {r.layout} (one entry per layer)"
    return f"layout: scanned ({scan_plan(dataclasses.replace(r.cfg, scan_layers=True)).describe()})"


def format_report(r: Report) -> str:
    """The human-readable report ``python -m k3jax.convert inspect`` prints."""
    lines = [f"{r.path}: {r.kind} checkpoint", *_config_lines(r.cfg), _layout_line(r),
             f"quantisation: {r.quantisation}",
             "dtypes: " + ", ".join(f"{n} {d}" for d, n in sorted(r.dtypes.items())),
             f"parameters: total {r.total:,}, active {r.active:,}",
             f"{'component':<18}{'parameters':>16}{'active':>16}{'bytes':>16}"]
    for c in COMPONENTS:
        active = r.params[c] - round(r.inactive[c])
        lines.append(f"{c:<18}{r.params[c]:>16,}{active:>16,}{r.nbytes[c]:>16,}")
    for part, name in (("vision_tower", "vision tower"), ("mm_projector", "vision projector")):
        if part in r.vision:
            lines.append(f"{name:<18}{r.vision[part]:>16,}{r.vision[part]:>16,}{r.vision_bytes[part]:>16,}")
    nbytes = sum(r.nbytes.values()) + sum(r.vision_bytes.values())
    lines.append(f"{'total':<18}{r.total:>16,}{r.active:>16,}{nbytes:>16,}")
    if r.problems:
        lines.append(f"problems: {len(r.problems)}")
        lines += [f"  {p}" for p in r.problems]
    else:
        lines.append("keys: every expected tensor present, none unexpected or mis-shaped")
    return "\n".join(lines)
