"""Command line: a model of the original Transformer-XL PyTorch code, with its vocabulary, as a
memjax workdir that memjax.evaluate and memjax.generate read (memjax/convert/transfo_xl_original.py
says how the files are read safely and what is converted).

`python -m memjax.import_transfo_xl --model=model.pt --corpus=cache.pt --workdir=DIR`
"""

import argparse
from typing import Optional, Sequence

from memjax.convert import hf_io
from memjax.convert import transfo_xl_original as original
from memjax.training import loop


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog='python -m memjax.import_transfo_xl',
        description='Import a model of the original Transformer-XL PyTorch code (model.pt) and its vocabulary '
                    '(the data\'s cache.pt) into a memjax workdir.')
    parser.add_argument('--model', required=True, help='model.pt written by pytorch/train.py')
    parser.add_argument('--corpus', required=True, help='cache.pt of the data it was trained on')
    parser.add_argument('--workdir', required=True, help='a new workdir to write')
    args = parser.parse_args(argv)

    def job():
        config, params = original.read_model(args.model)
        tokenizer = original.read_vocabulary(args.corpus, config.vocab_size)
        loop.write_imported(config, params, tokenizer, args.workdir)
        return (f'Imported {hf_io.parameter_count(params):,} parameters and a {tokenizer.kind} vocabulary of '
                f'{tokenizer.vocab_size:,} into {args.workdir} ({hf_io.config_summary(config)}).')

    hf_io.run_import(job)


if __name__ == '__main__':
    hf_io.command_main(main)
