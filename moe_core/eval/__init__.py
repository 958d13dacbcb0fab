"""Evaluation: loss and perplexity on prepared splits, comparison tables against dense baselines,
generations for a fixed project-owned prompt set, and an lm-evaluation-harness adapter.

    from moe_core.eval.perplexity import evaluate_splits, comparison_table
    from moe_core.eval.generate import PROMPTS, PromptSetConfig, generate_samples

    results = evaluate_splits(model, "runs/data", splits=("validation", "test"))
    print(results["validation"].perplexity)

Modules: `batches` (fixed-order evaluation batches from prepared data), `perplexity`, `bits_per_byte`
(a loss comparable across tokenizers), `finite` (NaN/inf weights in a saved model), `prompts`, `generate`,
`harness` (needs ``lm-eval``; imported only when used), `cli` (``moe-lab eval``).
"""
