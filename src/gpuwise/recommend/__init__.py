"""Which accelerator, how many, how fast and for how much: every catalog row and GPU count ranked for one
workload, to train it (search.py, walking plan's remedies) or to serve it (serve.py), priced (prices.py) and
filtered and ranked alike (rank.py); with no workload, six common jobs ranked the same way (guide.py). The rows
are option.py's; what is asked, request.py's.
"""
