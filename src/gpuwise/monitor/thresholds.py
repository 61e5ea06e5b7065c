"""The monitor's thresholds, each with its source: what the rules in ``monitor.rules`` compare against.

Thresholds are relative to step time (shares) where they can be; the published values are from
``/work/shared/reference/recommend-watch-anchors.md`` §B4 and the §B6 CPU runs.
"""

from __future__ import annotations

from gpuwise.units import MiB

# Warm-up: step 1 carries CUDA context creation, cuDNN autotuning, torch.compile, the workers' first batches all at
# once; step 2 the optimizer's lazy state allocation (peak memory differs); recompiles and new shapes can follow for a
# few more, hence 10 % of a long run. SageMaker keeps initialisation apart too (MaxInitializationTime).
WARMUP_MIN_STEPS = 2
WARMUP_FRACTION = 0.10
MIN_JUDGED_STEPS = 3  # fewer judged steps than this: step-based classes are not judged (a median of 2 is a guess)

# Windows and patience: SageMaker's rules judge windows with a patience (LowGPUUtilization window=500 samples;
# CPUBottleneck/IOBottleneck fire when the condition holds "> 50 % of the time"). 20 steps is short enough that a
# phase change (an epoch with a cold cache) shows as its own window and long enough that its median ignores up to 9
# slow steps; 30 samples is 30 s at the monitor's 1 Hz.
WINDOW_STEPS = 20
WINDOW_SAMPLES = 30
PATIENCE = 0.5  # SageMaker CPUBottleneck/IOBottleneck threshold=50 (% of the time the condition holds)

# Input-bound: PyTorch TB plugin says DataLoader > 5 % of the step. Deviation: §B6 measured 0.18-0.27 data-wait share
# on a healthy no-sleep 0-worker CPU loop (collate and tensor creation) and 0.13-0.15 with 4 workers on a 5 ms/sample
# dataset, while the truly input-bound 0-worker case was 0.69-0.73. 0.30 sits above every healthy figure with margin
# and far below the input-bound one.
INPUT_WAIT_SHARE = 0.30
# How many workers a process may be told to start. Loading that burns CPU (decode, augment) gets the cores less one
# kept for training (``environment.workers_cap``, the rule doctor and train share). Loading that mostly waits (disk,
# network, a sleep: the process's CPU time during the wait, or each worker's CPU, under IO_CPU_SHARE of the wall
# time) gains from more workers than cores (environment.IO_WORKERS_PER_CORE a usable core).
IO_CPU_SHARE = 0.5
# ... judged against the CPU the loading could have had, not against a whole core: the host's cores less those busy
# with other work (HostSample.cpu_pct summed, less this process and its workers), shared among the loaders (issue 29:
# a CPU-bound loader given 40 % of a core on a 2-core host saturated by other work was called "waits on I/O"). A
# loader offered less than LOADER_STARVED_CORE of a core that used what it was offered is CPU-starved: more workers
# only split the same few free cycles.
LOADER_STARVED_CORE = 0.8
# psutil's per-core and per-process percentages are read a few ms apart, each over ~1 s: a core counts as free when
# 0.8 of it is (the workers' cap floors the free cores after adding this slack).
FREE_CORE_SLACK = 0.2
LOADER_MIN_CORE = 0.05  # a loader offered under 5 % of a core: counted as 5 % (the ratio's guard, not a finding)

# Communication-bound: the TB plugin's "communication > 10 % of the step" rule, kept: we count only the exposed part
# (what backward did not hide), which is pure loss, so the published value needs no margin.
COMM_EXPOSED_SHARE = 0.10

# Host-bound, low duty cycle: TB plugin "GPU util < 50 % => increase batch"; KempnerPulse/NVIDIA DCGM guidance
# "SM_ACTIVE < 50 % likely indicates ineffective GPU usage". SageMaker LowGPUUtilization uses p95 < 70 %; we take the
# lower, median-based 50 % because the data wait and exposed comm (which also idle the GPU) are ruled out first.
HOST_UTIL_PCT = 50.0
# Host-bound, "busy, low SM use": KempnerPulse class 10, GR >= 40 % and SM < 25 % ("overhead, sync, or small kernels").
HOST_BUSY_UTIL_PCT = 40.0
HOST_SM_ACTIVE_PCT = 25.0
# Host-bound on a CPU run: the process holds about one core (>= CPU_HOST_BUSY_PCT and < CPU_HOST_ONE_CORE_PCT of a
# core) while torch has >= 2 intra-op threads and >= 2 cores free of other work, and the step is short. torch
# parallelises an op only past at::internal::GRAIN_SIZE (32768 elements), so a tiny model's ops run on the caller's
# thread and Python/dispatch (~10 us an op) is the step. Measured here (benchmarks/host_rules_check.py, 2 threads on 2
# cores): a 64-wide 3-layer MLP at batch 32 steps in 0.5-2.3 ms on 0.56-1.0 cores; at batch 2048 in 1.5-2.0 ms on
# 1.9-2.0 cores (~100x the samples/s). 20 ms is ~1000-2000 ops of dispatch: a small model's whole step.
CPU_HOST_BUSY_PCT = 70.0
CPU_HOST_ONE_CORE_PCT = 130.0
CPU_HOST_STEP_S = 0.020
# Oversubscribed: runnable threads past the cores. The cores are saturated (all cores together >= OVERSUB_BUSY_PCT
# busy: a run queue of threads in uninterruptible I/O sleep is not CPU contention) AND, with >= 2 compute threads
# (torch intra-op threads x processes), one of: threads x processes > usable cores; the 1-minute load >=
# OVERSUB_LOAD_RATIO x cores (a run at threads == cores alone holds load ~= cores: the caller is one of the pool's
# threads); or (a CPU run) the process gets < OVERSUB_GOT_RATIO of the cores its threads would run on (its threads
# are runnable and wait for cores). Issue 29: torch's default 2 threads on a 2-core box saturated by other work,
# 793 ms -> 31 ms a step with OMP_NUM_THREADS=1 (OpenMP's barriers wait on the preempted thread).
OVERSUB_BUSY_PCT = 90.0
OVERSUB_LOAD_RATIO = 1.25
OVERSUB_GOT_RATIO = 0.75
OVERSUB_HOST_CPU_PCT = 50.0  # the run's process at >= half a core: its host side works (else its threads idle)
# ... and only where the run's own threads wait for a core: the kernel's per-thread run-queue time (schedstat)
# summed over the process tree, on average at least half a thread waiting. A loop that sleeps or waits on I/O on a
# loaded box has ~0 and is not slowed by the load (measured: a sleeping loop 0.0 while the 2-core box ran at load 4.8;
# a 2-thread matmul loop there 1.4-3.2, its step 120 ms against 21 ms with one thread).
OVERSUB_RUNQ_THREADS = 0.5
# Per-kernel CPU cost in eager PyTorch: HTA's launch statistics put the CPU launch at 5-20 us (train-monitor-anchors
# §3); 10 us is the middle, used only as evidence (kernels_per_step x this vs the step time).
LAUNCH_COST_S = 10e-6
# Watch without step timings: SageMaker CPUBottleneck (GPU < 10 % while CPU > 90 %); a Python main process pinned at
# >= 90 % of one core is the GIL-bound version of "CPU > 90 %".
HOST_PROCESS_CPU_PCT = 90.0
WORKERS_BUSY_PCT = 90.0  # loader workers each >= 90 % of a core: they are the ones who cannot keep up
IOWAIT_PCT = 50.0  # SageMaker IOBottleneck(io_threshold=50)

# A GPU is "busy" in a sample at >= 10 % duty cycle: SageMaker's gpu_threshold=10 (below it the GPU counts as idle).
BUSY_UTIL_PCT = 10.0

# Throttled: a throttling clock-event reason (power cap, thermal, hardware slowdown, power brake) in a busy sample AND
# the SM clock below 90 % of max (gpustat#135 compares current with max clocks). GPU Boost moves the clock a few bins
# with temperature and voltage in a healthy run, so a reason with the clock within 10 % of max is not called a loss.
THROTTLE_CLOCK_RATIO = 0.90
# A power cap is a loss only when someone lowered the limit: at the board's default limit a busy H100/H200 runs at its
# power design point (a GEMM at 699 of 700 W holds ~1.6 of 1.98 GHz), which no setting of ours changes. Lowered =
# the enforced limit under 95% of nvmlDeviceGetPowerManagementDefaultLimit; unknown default: not judged.
POWER_LOWERED_RATIO = 0.95
# Input-bound needs the GPU to wait too: a loop that does not synchronise each step (a user's own, under Monitor)
# times next() while the GPU still runs queued work, so a high duty cycle over the same span vetoes it.
INPUT_GPU_BUSY_PCT = 90
# ... and the wait must be the data's: where the loop's thread spent half the time in next() runnable with no core
# free (Linux schedstat run-queue time), the wait is CPU contention (watch_truth g: a loop reading a list, OMP 1
# thread, beside a hog on every core was called input-bound), left to the oversubscribed rule.
INPUT_RUNQ_SHARE = 0.5
# The other side: a wait off the CPU (its CPU time under IO_CPU_SHARE) whose run-queue time is under a fifth of it
# waited on I/O, a sleep or the network, even on a host whose cores other work keeps busy (the CPU time alone cannot
# tell those apart there: tests/monitor/test_real_runs.py's sleeping loader beside a loaded CI box).
IO_RUNQ_SHARE = 0.2

# Fragmentation: no published share; torch's docs say reserved >> allocated. We call it when a quarter of the pool is
# reserved above the peak allocation (the caching allocator's rounding to 2 MiB / 20 MiB blocks explains a few %), and
# the gap is >= 512 MiB (a tiny model's 50 MiB gap is harmless), or when alloc retries rise after the warm-up
# (torchtitan logs any num_alloc_retries > 0; Composer calls 2 consecutive rises thrashing).
FRAG_GAP_SHARE = 0.25
FRAG_MIN_GAP_BYTES = 512 * MiB
ALLOC_RETRIES_MIN = 1

# Memory-full without an OOM: the TB plugin warns at peak > 90 % of the device. Deviation: 95 %, because a planned run
# aims near the device (90 % is a fine operating point) and NVML's "used" includes the CUDA context (~0.5 GiB).
MEMORY_FULL_SHARE = 0.95

# Roofline from GPM alone: KempnerPulse class 6 memory-bound DRAM >= 50 % & SM < 50 %; class 7 compute-heavy SM >= 80 %
# and class 2 tensor-heavy Tensor >= 50 % & SM >= 60 %.
GPM_DRAM_HEAVY_PCT = 50.0
GPM_SM_LOW_PCT = 50.0
GPM_SM_HEAVY_PCT = 80.0
GPM_TENSOR_HEAVY_PCT = 50.0
GPM_TENSOR_SM_PCT = 60.0

PRIMARY_RULE = ("memory-full first when an OOM happened; then the loss class (input-bound, communication-bound, "
                "straggler, oversubscribed, stalls, host-bound, throttled) with the largest share of step time; then "
                "the risks (memory-full near the limit, then memory-leak, then fragmentation); then the roofline side "
                "(memory-bound or compute-bound), which only fires when no loss class did")
