"""One GPU's slice of a tensor-, pipeline-, context- or expert-parallel run, captured as it runs (not a formula after):
tensor.py (--tp, --sequence-parallel), pipeline.py (--pp), context.py (--cp), expert.py (--ep, and the experts'
share of --tp), layout.py (what they share, and the Layout the plan reports), rank.py (the checks, and the step cut
to one rank), sharding.py (the model states split over the data-parallel ranks).
"""
