"""Learning: how an iteration's experience trains the actor and the critic, for one process and for each rank of a
data-parallel group alike.

learners.py (a module with its optimiser and schedule), optim.py (AdamW, 8-bit AdamW, warm-up + cosine), batches.py
(epochs x mini-batches x micro-batches, token budgets, data-parallel shares), losses.py (one micro-batch's policy
and value loss), update.py (the accumulation loop, skipped non-finite steps, the actor's and the critic's updates),
advantages.py (KL-shaped rewards into advantages through the pure functions of rlfuse/algos), checkpoint.py (what a
checkpoint holds and how it is restored), divergence.py (a loss that blows up without a NaN, and an RL update that
moves the policy too far: pure Python).
"""
