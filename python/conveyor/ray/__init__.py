"""Conveyor on Ray: Ray Serve replicas behind the OpenAI API (conveyor.ray.serve) and
Ray Data batch inference (conveyor.ray.data). Needs the `ray` extra:
pip install 'conveyor[ray]'. Nothing here is imported by `import conveyor`."""


def require_ray(what: str):
    """Imports ray, or raises ImportError saying which extra to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{what} needs Ray: pip install 'conveyor[ray]' ({e})") from None
    return ray


def threads_for(num_cpus) -> int:
    """Engine threads for an actor holding `num_cpus` CPUs: one per whole CPU, at least one
    (Ray sets OMP_NUM_THREADS the same way, so the two agree). num_cpus=0 (an actor Ray
    does not count) gets one thread."""
    if num_cpus is None:
        return 1
    if isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float)) or not num_cpus >= 0:
        raise ValueError(f"num_cpus must be a number >= 0, got {num_cpus!r}")
    return max(1, int(num_cpus))
