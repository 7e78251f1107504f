"""The keys of a fit config (and of the fit metrics a client sends back), defined once.

A strategy writes these keys into the config it sends with each fit task; the client
SDK (`TorchClient`, the secure fit), the simulations and the differential-privacy code
read them. Every module spells a key through these names, so a sender and its reader
cannot drift apart.

>>> from fedloom.fit_config import MAX_UPDATE_NORM
>>> {MAX_UPDATE_NORM: 1.0}
{'max_update_norm': 1.0}
"""

from __future__ import annotations

# -- training -------------------------------------------------------------------------
#: Passes over the local training data in one fit (int >= 1).
LOCAL_EPOCHS = "local_epochs"
#: The client's learning rate (float > 0); wins over `CLIENT_LR` when both are sent.
LEARNING_RATE = "lr"
#: The client learning rate of the adaptive strategies (FedAdam, FedYogi, FedAdagrad).
CLIENT_LR = "eta_l"
#: Seeds the client's randomness before it trains (int), for reproducible runs.
SEED = "seed"
#: The round a task belongs to (int), in the fit and evaluate configs of the strategies.
SERVER_ROUND = "server_round"
#: Flower 1.42's spelling of `SERVER_ROUND`: every Flower strategy puts it in the train
#: and evaluate configs, and ClientApps read it; the Flower bridge sends it too.
FLOWER_SERVER_ROUND = "server-round"
#: FedProx's proximal-term weight ``mu`` (float >= 0); echoed back as a fit metric
#: of the same name by a client that applied it.
PROXIMAL_MU = "proximal_mu"
#: Flower 1.42's spelling of `PROXIMAL_MU`, read too so Flower's FedProx works unchanged.
FLOWER_PROXIMAL_MU = "proximal-mu"

# -- update-norm bound ----------------------------------------------------------------
#: The bound on the global L2 norm of the client's update (float > 0): clients clip to it.
MAX_UPDATE_NORM = "max_update_norm"
#: What the server does with an update above the bound: ``"clip"`` or ``"reject"``.
NORM_BOUND_MODE = "norm_bound_mode"
#: Fit metric: the L2 norm of the client's update before it clipped it (float).
UPDATE_NORM = "update_norm"

# -- distributed differential privacy (fedloom.privacy, inside secure aggregation) ------
#: The L2 norm c each client clips its flattened update to (float > 0).
DDP_CLIP_NORM = "ddp_clip_norm"
#: The factor gamma applied after the rotation and before rounding (float > 0).
DDP_SCALE = "ddp_scale"
#: The Skellam parameter mu each client adds per coordinate (float >= 0).
DDP_CLIENT_MU = "ddp_client_mu"
#: The encoding works modulo ``2**bits`` (int in [2, 32]).
DDP_BITS = "ddp_bits"
#: The seed of the randomized Hadamard rotation (hex, at least 16 bytes).
DDP_ROTATION_SEED = "ddp_rotation_seed"
#: The least survivors whose sum may be unmasked (int): the round's survivor floor.
DDP_MIN_SURVIVORS = "ddp_min_survivors"
