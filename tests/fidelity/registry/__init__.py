"""The installed transformers' conversion registry as the test list (`cases.py`): every case a tiny
model (`tiny.py`) saved through the Stager and exported kept and in bf16, compared with `save_pretrained`
(`check.py`), spread over test_shard_<k>.py; `test_list.py` proves nothing is left out silently."""
