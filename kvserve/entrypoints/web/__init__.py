"""The browser side of ``kvserve serve``: the playground at /, the live dashboard at /dashboard."""
