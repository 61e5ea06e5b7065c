"""The step-time model's error bar, as its own held-out validation measured it; printed beside every step time.

The figures are benchmarks/RESULTS.md's of 2026-12-01, on the rows no coefficient was fitted on
(``benchmarks/recommend_order.py``, ``benchmarks/speed_validation.py``): Lambda BERT-large on five boards, median
14.7%, worst 26.0%; planner anchors #3, #4, #7, median 13.9%, worst 16.6%; Lambda ResNet-50 on nine boards, median
43.8%, worst +119%. No published fp32 or multi-GPU step was among them.
"""

HELD_OUT_ERROR = ("held-out error: median 15% (worst 26%) on transformer training, 44% (worst +119%) on "
                  "ResNet-50; fp32 and multi-GPU steps not yet validated")
