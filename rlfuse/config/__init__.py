"""Typed run configuration: one dataclass per section (sections.py), loaded from YAML plus `section.field=value`
overrides (load.py), every field validated eagerly (validate.py), the fields' own docstrings for `--help` (docs.py),
and what each RL algorithm needs (algorithms.py).

The bottom of the house: it imports nothing of rlfuse but `errors` and `files`, and loading a config imports no
torch. `load_config` returns what the file says; what only the planner and the placement checker can tell (an auto
placement, a layout that places every role, a model a pipeline can cut) is `rlfuse.plan.resolve.resolve`'s, run
once by the CLI and the API before a run.
"""

from rlfuse.config.docs import field_docs, field_summary, section_class
from rlfuse.config.load import config_from_dict, config_to_dict, load_config, save_config, split_args
from rlfuse.config.sections import (
                                    DATA_KINDS,
                                    MIN_WORKERS,
                                    OPTIMIZERS,
                                    QUANTIZATIONS,
                                    STRATEGIES,
                                    TRACKERS,
                                    Config,
                                    DataConfig,
                                    ModelConfig,
                                    PlacementConfig,
                                    RLConfig,
                                    RMConfig,
                                    RolloutConfig,
                                    RunConfig,
                                    SFTConfig,
                                    checkpointing_on,
                                    fusion_on,
                                    own_generator_copy,
)
from rlfuse.config.validate import (
                                    TRACKER_PACKAGES,
                                    is_gpu_share,
                                    is_hub_id,
                                    package_installed,
                                    tracker_missing,
                                    validate,
)

__all__ = ["Config", "RunConfig", "DataConfig", "ModelConfig", "SFTConfig", "RMConfig", "RLConfig", "RolloutConfig",
           "PlacementConfig", "DATA_KINDS", "QUANTIZATIONS", "OPTIMIZERS", "TRACKERS", "STRATEGIES", "MIN_WORKERS",
           "fusion_on", "checkpointing_on", "own_generator_copy", "load_config", "config_from_dict", "config_to_dict", "save_config",
           "split_args", "validate", "is_hub_id", "is_gpu_share", "package_installed", "tracker_missing",
           "TRACKER_PACKAGES", "field_docs", "field_summary", "section_class"]
