"""The fleet export: node-local ROOTs on many nodes, one HF export built together through the exchange.

node.py is one node's part of the protocol, lead.py the leader's commit at its end, exchange.py the step's
records on the exchange and the waits for other nodes, plan.py the plan every node computes alike (the
mirror of every shard, the owner of each output file), build.py an artefact's files built on that mirror,
tasks.py the daemon's export task and publish lane of such a step, hub.py its Hub lane.
"""
