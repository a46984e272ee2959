"""Locust load shapes: steady, step and spike, sized by locust's own -u, -r and -t.

They live outside the locustfile because locust runs the first shape class it finds in a
locustfile's namespace: the locustfile exposes only the one BATCHLINE_LT_SHAPE names.
Locust does not stop a shape run at -t (it waits for the shape), so every shape ends by itself
after the run time (-t, default 60 s): no shape runs unbounded.
"""

from __future__ import annotations

from locust import LoadTestShape

DEFAULT_USERS = 10
DEFAULT_RUN_TIME_S = 60.0


class _SizedShape(LoadTestShape):
    """Reads peak users (-u), spawn rate (-r) and duration (-t) from locust's options."""

    abstract = True
    use_common_options = True

    def _options(self) -> tuple[int, float, float]:
        options = self.runner.environment.parsed_options if self.runner else None
        users = getattr(options, "num_users", None) or DEFAULT_USERS
        rate = getattr(options, "spawn_rate", None) or float(users)
        run_time = getattr(options, "run_time", None) or DEFAULT_RUN_TIME_S
        return int(users), float(rate), float(run_time)

    def users_at(self, fraction: float, peak: int) -> int:
        raise NotImplementedError

    def tick(self) -> tuple[int, float] | None:
        peak, rate, run_time = self._options()
        elapsed = self.get_run_time()
        if elapsed >= run_time:
            return None
        return max(1, self.users_at(elapsed / run_time, peak)), rate


class SteadyShape(_SizedShape):
    """The peak user count for the whole run: the baseline."""

    def users_at(self, fraction: float, peak: int) -> int:
        return peak


class StepShape(_SizedShape):
    """Four equal steps up to the peak: where does latency start to climb?"""

    steps = 4

    def users_at(self, fraction: float, peak: int) -> int:
        step = min(self.steps - 1, int(fraction * self.steps))
        return round(peak * (step + 1) / self.steps)


class SpikeShape(_SizedShape):
    """A quarter of the peak, the full peak from 40% to 60% of the run, then a quarter again:
    does the server recover (queue drains, latency returns) after a burst?"""

    def users_at(self, fraction: float, peak: int) -> int:
        return peak if 0.4 <= fraction < 0.6 else max(1, peak // 4)


SHAPES: dict[str, type[_SizedShape]] = {"steady": SteadyShape, "step": StepShape, "spike": SpikeShape}
