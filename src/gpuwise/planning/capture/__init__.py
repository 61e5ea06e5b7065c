"""The capture: one real step of the model on fake tensors, recorded op by op and scaled to the full model.

``step`` runs the step under the ``tracker`` (with ``autocast``'s casts as CUDA makes them, the ``optimizers`` as their
libraries store state, MoE ``routing`` stand-ins); ``blocks`` finds which blocks are alike; ``scaling`` carries a few
small captures to any batch and depth; ``workload`` assembles the result, and ``cache`` keeps captures on disk.
"""
