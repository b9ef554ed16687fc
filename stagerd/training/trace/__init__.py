"""The to-Hub plan of a transformers model, traced at save time from transformers' own conversion code.

resolve.py runs the model's conversion on traced tensors (traced.py) and turns the result into a plan,
boxes.py maps a traced view of a staged tensor to the box the plan declares, parts.py a traced tensor made
of parts, storages.py the real storages save_pretrained sizes the tensors by.
"""
