"""GPU telemetry: an NVML sampler on its own thread (`sampler`), the join of each
device to the PD instance that owns it (`join`), and a Prometheus collector over
the judge's joined view (`collector`)."""
