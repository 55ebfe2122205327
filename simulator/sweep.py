"""A sweep of (KV pool size, batch) points for one machine and model, optionally on several
processes (each builds its own routing model from the same seed, so results do not depend on
the number of workers)."""

from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path

from domain.model_spec import ModelSpec, WeightFormat, qwen36_35b_a3b
from simulator.cost_model import CostParams
from simulator.hardware import HardwareProfile
from simulator.params import StrictParams
from simulator.predict import Deployment, PointResult, Workload, predict_point
from simulator.routing import LocalityParams, RoutingModel, make_routing

CALIBRATION_DIR = Path(__file__).parent / "calibration"
# NOTE: simulator/calibration.py writes this `engine` text into the files fitted on SPEC.md's reference table
CUSTOMER_ENGINE_PREFIX = "the customer's existing engine"
CUSTOMER_ENGINE = "customer-engine"  # what a prediction's JSON `engine` says for those files
OUR_ENGINE = "fluxtide"
# One rule for every default (docs/simulator.md, "One default rule"): fluxtide's best held-out H200 profile on the
# H200, and on any other card its card-independent part, its engine overheads carried over to the card's bandwidths.
# h200_records_v6 held out 9 of 13 of session 20's predict aggregates within +-10 % (max +31.7 %, a split burst),
# h200_v2 5 of 13 (max +90.7 %, ladder c16). v5 is v6 without the eager prefill terms, which are the H200's compute
# ("Prefill compute"); their decode predictions are identical. A card's own `calibrate` output (<card>_v<N>, fitted
# on fluxtide) takes precedence over the carried-over one; an entry here over both.
# The H100 SXM gets v6 itself, carried over (session 25, docs/simulator.md "Held out on an H100"): it is the H200's
# die (GH100, 132 SMs, the same clocks), so v6's eager prefill terms, which are GH100 compute and host work, hold
# there; held out on its first records they put the mixed gap p50 within -5.5..+0.6 % and the streamed prefills
# within -12..+2 %, where v5 was -16..-64 % and -16..-32 %. Its decode terms are v5's, so decode does not move.
DEFAULT_CALIBRATIONS = {"h200": "h200_records_v6", "h100": "h200_records_v6"}
CARRIED_OVER_DEFAULT = "h200_records_v5"

BUILTIN_MODELS = {
    "qwen3.6-35b-a3b-fp8": WeightFormat.FP8_BLOCK,
    "qwen3.6-35b-a3b-nvfp4": WeightFormat.NVFP4,
    "qwen3.6-35b-a3b-bf16": WeightFormat.BF16,
}


def resolve_model(name_or_path: str) -> tuple[str, ModelSpec]:
    """A built-in model name, or a checkpoint directory (or config.json) to read geometry from."""
    if name_or_path in BUILTIN_MODELS:
        return name_or_path, qwen36_35b_a3b(BUILTIN_MODELS[name_or_path])
    path = Path(name_or_path)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(f"--model {name_or_path!r}: not a built-in model {sorted(BUILTIN_MODELS)} "
                         f"and no config.json there")
    spec = ModelSpec.from_hf_config(json.loads(config.read_text()))
    return str(name_or_path), spec


@dataclass(frozen=True)
class Calibration(StrictParams):
    """A calibration file (simulator/calibration/<hardware>_v<N>.json), strictly parsed."""

    format_version: int
    name: str
    hardware: str
    model: str
    engine: str
    procedure: str
    reading: dict
    seed: int
    deployment: dict
    workload: dict
    cost: dict
    routing: dict
    validation: dict
    candidates: list
    provenance: dict = field(default_factory=dict)  # records and fields the fit read (newer files)

    def check_valid(self) -> None:
        if self.format_version != 1:
            raise ValueError(f"calibration format_version {self.format_version} unsupported (1)")
        self.cost_params()
        self.deployment_params()
        self.locality_params()
        Workload.from_dict(self.workload, where=f"{self.name}.workload")

    def cost_params(self) -> CostParams:
        return CostParams.from_dict(self.cost, where=f"{self.name}.cost")

    def deployment_params(self) -> Deployment:
        return Deployment.from_dict(self.deployment, where=f"{self.name}.deployment")

    def locality_params(self) -> LocalityParams:
        return LocalityParams.from_dict(self.routing.get("locality", {}), where=f"{self.name}.routing")

    @property
    def customer_engine(self) -> bool:
        """Whether this file was fitted on the customer's existing engine (SPEC.md's reference table: the
        `engine` text simulator/calibration.py writes for it), not on fluxtide's own records."""
        return self.engine.strip().startswith(CUSTOMER_ENGINE_PREFIX)

    @property
    def predicts(self) -> str:
        """The engine a prediction with this calibration is for (the JSON's `engine`)."""
        return CUSTOMER_ENGINE if self.customer_engine else OUR_ENGINE

    def describe(self, hardware: str) -> str:
        """What a prediction's title says of this calibration: the engine it predicts, its name, the card and
        engine it was measured on (the file's own `hardware` and `engine` fields), and whether it is carried
        over to another card."""
        engine = self.engine.strip()
        joiner = ", " if engine.startswith("fitted") else " with "  # "fitted from the records ..." / "the customer's ..."
        who = ("predicts the customer's existing engine, not fluxtide" if self.customer_engine
               else "predicts fluxtide")
        text = f"{who}: calibration {self.name}: measured on {self.hardware}{joiner}{engine}"
        if self.hardware != hardware:
            text += f"; its engine overheads carried over to {hardware}"
        return text

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls.from_dict(json.loads(Path(path).read_text()), where=str(path))

    @classmethod
    def resolve(cls, name_or_path: str) -> Calibration:
        """A file path, or the name of a file in simulator/calibration/ (e.g. `h200_v1`)."""
        path = Path(name_or_path)
        if path.is_file():
            return cls.load(path)
        named = CALIBRATION_DIR / f"{name_or_path}.json"
        if named.is_file():
            return cls.load(named)
        known = sorted(p.stem for p in CALIBRATION_DIR.glob("*_v*.json"))
        raise FileNotFoundError(f"--calibration {name_or_path!r}: no such file and no calibration of that "
                                f"name; known: {known}")


def _versions(hardware: str) -> list[Calibration]:
    """Every `<hardware>_v<N>.json` in CALIBRATION_DIR, oldest first."""
    def version(p: Path) -> int:
        return int(p.stem.rsplit("_v", 1)[1])

    return [Calibration.load(p) for p in sorted(CALIBRATION_DIR.glob(f"{hardware}_v*.json"), key=version)]


def find_calibration(hardware: str) -> tuple[Calibration, bool]:
    """The default calibration of `predict` and `mixed` on --hardware HARDWARE, and whether it was measured on that
    hardware: DEFAULT_CALIBRATIONS[hardware]; else the newest `<hardware>_v<N>` fitted on fluxtide (a user's own
    `calibrate` of the card); else CARRIED_OVER_DEFAULT, its engine overheads carried over. A calibration of the
    customer's engine (`rtx3090_v1`, `rtx3090_v2`) is never a default, on its own card either: it predicts
    another engine; name it with --calibration to compare (docs/simulator.md, "Which engine a prediction is for")."""
    if hardware in DEFAULT_CALIBRATIONS:
        chosen = Calibration.resolve(DEFAULT_CALIBRATIONS[hardware])
        return chosen, chosen.hardware == hardware
    own = [c for c in _versions(hardware) if not c.customer_engine]
    if own:
        return own[-1], True
    carried = Calibration.resolve(CARRIED_OVER_DEFAULT)
    return carried, carried.hardware == hardware


def calibration_for(name: str | None, hardware: str) -> tuple[Calibration, bool]:
    """`--calibration NAME` (a file or a name; it may come from another card, e.g. h200_v2 on a 4090) or, without
    one, find_calibration's default; and whether it was measured on `hardware`."""
    if name is None:
        return find_calibration(hardware)
    chosen = Calibration.resolve(name)
    return chosen, chosen.hardware == hardware


@dataclass(frozen=True)
class SweepConfig:
    model_name: str
    spec: ModelSpec
    hardware: HardwareProfile
    deployment: Deployment
    cost: CostParams
    routing: str  # locality | uniform | trace:FILE
    locality: LocalityParams
    workload: Workload
    seed: int
    calibration: str
    engine: str | None = None  # the engine the calibration predicts (Calibration.predicts)
    mixed_prefill_length: int | None = None  # --mixed-prefill-length (None: ft serve's default)


_routing_cache: dict = {}


def _routing_for(cfg: SweepConfig) -> RoutingModel:
    key = (cfg.routing, cfg.seed, cfg.locality, cfg.spec.num_layers, cfg.spec.num_experts, cfg.spec.top_k)
    if key not in _routing_cache:
        _routing_cache[key] = make_routing(cfg.routing, cfg.spec.num_layers, cfg.spec.num_experts,
                                           cfg.spec.top_k, cfg.seed, cfg.locality)
    return _routing_cache[key]


def _run_point(args: tuple[SweepConfig, int, int]) -> PointResult:
    cfg, kv, batch = args
    return predict_point(cfg.spec, cfg.model_name, cfg.hardware, cfg.deployment, cfg.cost, _routing_for(cfg),
                         kv, batch, cfg.workload, calibration=cfg.calibration, engine=cfg.engine,
                         mixed_prefill_length=cfg.mixed_prefill_length)


def run_sweep(cfg: SweepConfig, kv_sizes: list[int], batches: list[int], workers: int | None = None) -> list[PointResult]:
    points = [(cfg, kv, b) for b in batches for kv in kv_sizes]
    workers = min(len(points), workers if workers is not None else min(2, os.cpu_count() or 1))
    if workers <= 1:
        return [_run_point(p) for p in points]
    # NOTE: fork keeps start-up cheap; every worker rebuilds routing streams from the same seed.
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return pool.map(_run_point, points, chunksize=1)
