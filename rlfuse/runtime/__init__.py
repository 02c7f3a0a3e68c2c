"""Where the RL loop's steps run: in this process (local.py) or on Ray worker groups laid out by a placement spec
(ray_driver.py, ray_worker.py, ray_rollout.py, ray_train.py: data parallel through DDP; pipeline.py: the actor and
the critic as two opposite pipelines), behind two small protocols the loop sees, a rollout and a trainer
(protocols.py; backend.py picks them). Also the machine profile the planner reads (profile.py, profile_ray.py).

The ray_*.py modules (and profile_ray.py) import Ray; backend.py imports them only for a placement on Ray workers, so a
single-process run never imports Ray (tests/unit/test_ray_driver.py).
"""
