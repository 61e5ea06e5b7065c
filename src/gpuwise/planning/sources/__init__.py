"""Where the model comes from: the built-in zoo (zoo.py), a user's ``file.py:function`` (file.py), a model factory
from the Python API (factory.py), or a Hugging Face config.json (hf.py, with hf_build.py, hf_inputs.py and
hf_audio.py), found by a Hub id (hub.py) and read with its checkpoint's stored weights (checkpoint.py); each a
``Source`` (base.py); resolve.py picks the one the command line names.

Every source builds *inside* the fake mode, so nothing is allocated; only a Hub id's config.json is downloaded, and
only when the Hugging Face cache lacks it.
"""
