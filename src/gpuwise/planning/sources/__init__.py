"""Where the model comes from: the built-in zoo (zoo.py), a user's ``file.py:function`` (file.py), or a Hugging Face
config.json (hf.py, with hf_build.py, hf_inputs.py and hf_audio.py), each a ``Source`` (base.py); resolve.py picks
the one the command line names.

Every source builds *inside* the fake mode, so nothing is allocated and nothing is downloaded.
"""
