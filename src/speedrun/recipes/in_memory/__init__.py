"""What the in-memory families (cifar, cifar_resnet) share, written once: families whose whole dataset sits in
memory and trains from data.loader.DeviceLoader, with airbench's schedule, Lookahead, patch whitening and TTA.

config.py is the settings they share (InMemoryConfig, which each family's config inherits), data.py the answers to
the runner they give alike (the data, its description and signature, the smoke test, notes, a saved model's card,
step counts, FLOPs, the check before a run), loop.py one training run (the training state with Lookahead, the
schedule loop, evaluation), network.py the user's network (--model MODULE:FUNCTION) in any of them.
A family is its network and its differences: its config's own settings, its checks, and a Hooks object
(loop.py) that builds the network and its optimizers and holds the tricks the shared loop does not know.
"""
