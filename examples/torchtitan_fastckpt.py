"""torchtitan configs that checkpoint through fastckpt (copy and adapt).

    PYTHONPATH=examples torchrun --nproc_per_node 8 -m torchtitan.train \
        --module torchtitan_fastckpt --config llama3_8b_fastckpt --checkpoint.interval 500

Each function takes one of torchtitan's own configs and swaps its checkpoint manager for
``fastckpt.torchtitan.CheckpointManager``, keeping every other setting; the ``--checkpoint.*``
command-line flags still apply. See docs/integrations/torchtitan.md.
"""

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel

from fastckpt.torchtitan import use_fastckpt


def llama3_debugmodel_fastckpt():
    return use_fastckpt(llama3_debugmodel(), enable=True, interval=10, keep_latest_k=3,
                        async_mode="async")


def llama3_8b_fastckpt():
    return use_fastckpt(llama3_8b(), enable=True, keep_latest_k=3, async_mode="async")
