"""The runtime: the processes that host the core on Ray, on one machine or a cluster.

The launcher and cluster start and watch one learner process and one process per actor (placed on
nodes and cores of their own), ship the model to them and keep them between runs; an actor process
runs rollouts (`dph_async.actors`) and, between runs, the engine's other jobs: evaluation and
pre-sampling. It imports only what lies below it: the core and the data flow (tests/test_layers.py).
"""
