"""``capture-proxy audit``: prove that captured data trains, by recomputing it with the model.

The package reads bottom to top:

- ``sources``: the training samples of a store or a proxy's read API, built by the exporters'
  own code (the npz archive, the Arrow export, the token tree), so the audit checks what a
  trainer receives, not a second implementation of it. No torch.
- ``compare``: the pure comparison math (numpy): per generated token the log prob delta, the
  KL estimators and importance ratios trainers report, routed-expert agreement, worst positions,
  thresholds and the verdict. No torch.
- ``model``: the only module that imports torch and transformers: one teacher-forced forward
  pass per sample, batched, that returns the model's log prob of every captured id and the
  router's top-k experts per MoE layer.
- ``report``: the summary text, the JSON document and the plot (matplotlib).
- ``run``: wires them for the command line (``capture_proxy.cli``).

Everything that needs torch, transformers or matplotlib is the optional extra
``capture-proxy[audit]``; the proxy never imports this package.
"""
