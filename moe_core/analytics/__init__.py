"""Router analytics and cost accounting: what the router does, and what each token costs.

    from moe_core.analytics.profile import ProfileConfig, collect_profile
    from moe_core.analytics.plots import render_all
    from moe_core.analytics.cost import PriceTable, cost_report

    profile = collect_profile(model, batches_BS, token_classes_V=classes, domains_BS=domains)
    profile.to_dir("runs/profile")                   # profile.json + parquet tables, versioned
    render_all(profile, "runs/profile/plots")        # PNG (for MLflow) + interactive HTML
    print(cost_report(model.config, tokens_per_s=1.2e4, device="h100").to_markdown())

Modules: `stats` (pure statistics checked by hand in tests), `token_classes` (token -> class),
`profile` (collection and the versioned `RouterProfile`), `token_routing` (a text's token-to-expert
routing; the prompt set's, for the dashboard), `plots`, `cost` (money; FLOPs from
`moe_core.flops`), `cli` (``moe-lab analyze``).
Nothing here imports Prefect or MLflow; matplotlib and plotly load inside the plotting functions.
"""
