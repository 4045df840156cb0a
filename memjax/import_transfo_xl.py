"""Command line: a model of the original Transformer-XL PyTorch code, with its vocabulary, as a
memjax workdir that memjax.evaluate and memjax.generate read (memjax/convert/transfo_xl_original.py
says how the files are read safely and what is converted).

`python -m memjax.import_transfo_xl --model=model.pt --corpus=cache.pt --workdir=DIR`
"""

from typing import Optional, Sequence

from memjax.convert import hf_io
from memjax.convert import transfo_xl_original as original
from memjax.training import restore


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = hf_io.command_flags(
        argv, 'memjax.import_transfo_xl',
        'import a model of the original Transformer-XL PyTorch code (model.pt) and its vocabulary (the data\'s '
        'cache.pt) into a new memjax workdir. Needs torch to read the files: pip install -e \'.[parity]\'.',
        required={'model': 'model.pt written by pytorch/train.py', 'corpus': 'cache.pt of the data it was trained on',
                  'workdir': 'a new workdir to write'})

    def job():
        config, params = original.read_model(args.model)
        tokenizer, data_name = original.read_corpus(args.corpus, config.vocab_size)
        restore.write_imported(config, params, tokenizer, args.workdir, data_name)
        return (f'Imported {hf_io.parameter_count(params):,} parameters and a {tokenizer.kind} vocabulary of '
                f'{tokenizer.vocab_size:,} into {args.workdir} ({hf_io.config_summary(config)}).')

    hf_io.run_import(job)


if __name__ == '__main__':
    hf_io.command_main(main)
