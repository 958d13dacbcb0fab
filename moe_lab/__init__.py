"""The ``moe-lab`` program: the application layer above the library (`moe_core`), the orchestration
(`tasks`, `flows`, `deployments`) and the dashboard (`dashboard`).

    moe-lab --help            # every command (moe_lab.cli.COMMANDS)
    python -m moe_lab ...     # the same without the installed script
    python -m moe_core ...    # the library's commands alone: no Prefect, MLflow or dashboard import

Nothing below this package imports it: the library never reaches up into the flows, and the flows never
reach into the dashboard; what joins them (``train --dashboard``, ``run --dashboard``) lives here.
"""
