'''Looking inside trained models: the quantities the papers' analyses plot, computed from what the
model sows while it runs (`flax` intermediates: a no-op unless `apply` is asked for them).

  run = analysis.load('runs/xl')                      # the workdir's config, model and newest params
  for batch in analysis.text_batches(run, 'validation', 4):
      out, memory, sown = analysis.apply_sown(run.model, run.params, batch.inputs, memory)
      probs = analysis.per_layer(sown, 'attention')['probs']   # [n_layer, B, H, T, K]

One module per method (`attention` for Transformer-XL's, `lamemo`, `infinity`, `trams`, `skip`);
the notebooks in notebooks/ call them.
'''

from memjax.analysis.run import LoadedRun, Segment, apply_sown, load, per_layer, sown_over_text, text_batches

__all__ = ['LoadedRun', 'Segment', 'apply_sown', 'load', 'per_layer', 'sown_over_text', 'text_batches']
