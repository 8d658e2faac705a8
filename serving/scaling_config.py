"""How the pools scale: each pool's replica bounds and load targets (its own autoscaling policy,
serving/autoscaling.py) and the application-level SLO policy's options (serving/slo_autoscaling.py).
Part of AppConfig (serving/config.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from serving.config_base import ConfigModel as _Model


class PoolBounds(_Model):
    """A pool's replica bounds (per-pool autoscaling, and each pool under the SLO policy)."""
    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 lets an idle pool scale to zero (per-pool "
                              "autoscaling only): a request then waits for a replica to start.")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at start (default min_replicas).")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie within [min_replicas, max_replicas]")
        return self


class ScalingTargets(_Model):
    """The per-replica load targets of a pool's autoscaling policy (serving.autoscaling). They reach
    the replicas as the deployment's `user_config` (each replica reports its load as a fraction of
    them), so a new target is applied in place, without restarting a replica."""
    target_queued_tokens: float = Field(2048.0, gt=0, description="Prefill: queued prompt tokens per replica.")
    target_kv_utilization: float = Field(0.7, gt=0, le=1, description="Decode: KV-block utilization per replica.")
    target_running: float = Field(32.0, gt=0, description="Decode: running sequences per replica.")


class AutoscalingOptions(PoolBounds, ScalingTargets):
    """Per-pool autoscaling (serving.autoscaling); set on a pool to replace its fixed count."""
    upscale_delay_s: float = Field(5.0, ge=0, description="A scale-up must be wanted this long first.")
    downscale_delay_s: float = Field(30.0, ge=0, description="A scale-down must be wanted this long first.")
    downscale_to_zero_delay_s: float | None = Field(
        None, ge=0, description="With min_replicas 0: the last replica goes once no request has run or waited "
                                "this long (default downscale_delay_s). Scaling up from zero has no delay.")
    look_back_period_s: float = Field(5.0, gt=0, description="Window over which replica metrics are averaged.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas report their metrics.")
    warmup_s: float = Field(10.0, ge=0, description="No scale-down while a replica younger than this exists.")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="Scale down only below (1 - hysteresis) of the "
                                                          "target on one replica fewer.")

    @property
    def targets(self) -> ScalingTargets:
        return ScalingTargets(**{k: getattr(self, k) for k in ScalingTargets.model_fields})


class SloAutoscalingOptions(_Model):
    """Both pools sized together to meet TTFT/TPOT SLOs (serving/slo_autoscaling.py), from the router's
    live traffic and the planner's per-replica model (pdserve plan, calibrated by a bench report)."""
    policy: Literal["slo"] = Field("slo", description="The application-level SLO policy.")
    ttft_slo: float = Field(gt=0, description="Time to first token the p90 must meet, seconds.")
    tpot_slo: float = Field(gt=0, description="Time per output token the p90 must meet, seconds.")
    hardware: Literal["cpu", "h100", "h200", "a100", "l40s"] = Field(
        "cpu", description="Hardware of one replica for the per-replica model (cpu: this machine, measured "
                           "at start; else the planner's datasheet preset).")
    calibrate: str | None = Field(None, description="A `pdserve bench --json` report of this deployment: the "
                                  "model's efficiencies come from it (as `pdserve plan --calibrate`).")
    prefill_eff: float | None = Field(None, gt=0, le=1, description="Compute efficiency (overrides calibrate).")
    decode_eff: float | None = Field(None, gt=0, le=1, description="Bandwidth efficiency (overrides calibrate).")
    utilization: float = Field(0.8, gt=0, le=1, description="Decode pool's busy fraction at its SLO batch.")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="Scale down only if the load / (1 - hysteresis) "
                                                          "still fits one replica fewer.")
    warmup_s: float = Field(10.0, ge=0, description="No scale-down while a replica younger than this exists.")
    window_s: float = Field(30.0, gt=0, description="The router's measurement window (rate, lengths, p90s).")
    correction_gain: float = Field(0.5, ge=0, le=1, description="How far one tick moves the model's correction "
                                   "toward measured / predicted p90 (0: never correct the model).")
    upscale_delay_s: float = Field(5.0, ge=0, description="A scale-up must be wanted this long first.")
    downscale_delay_s: float = Field(30.0, ge=0, description="A scale-down must be wanted this long first.")
    look_back_period_s: float = Field(5.0, gt=0, description="Window over which reported metrics are averaged.")
    metrics_interval_s: float = Field(1.0, gt=0, description="How often replicas and the router report.")
    prefill: PoolBounds = Field(default_factory=PoolBounds, description="Prefill pool bounds.")
    decode: PoolBounds = Field(default_factory=PoolBounds, description="Decode pool bounds.")

    @model_validator(mode="after")
    def _not_to_zero(self):
        for pool in ("prefill", "decode"):
            if getattr(self, pool).min_replicas < 1:
                raise ValueError(f"{pool}.min_replicas 0: the SLO policy keeps at least one replica in each pool "
                                 "(a pool's own autoscaling block may scale it to zero)")
        return self
