"""Third-party stage plugins for mrl-plugins, one per stage, each selected by the name its
``StagePlugin`` registers (here the same as its entry point's):

* ``plugins.comm: example-comm`` -- experience batches as files in a directory (:mod:`.comm`);
* ``plugins.weight_sync: example-weights`` -- weight versions as files plus a ``latest`` pointer (:mod:`.weights`);
* ``plugins.rollout: example-rollout`` -- an in-process engine on a copy of the policy (:mod:`.rollout`).

Small on purpose: they show the hooks and the ends each stage builds (``mrl_plugins.hookspecs.channels``),
not a fast transport. The complete example in docs/plugins.md is :mod:`.comm`.
"""
