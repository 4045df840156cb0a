"""A Cloud Storage server on 127.0.0.1 (gcp-storage-emulator, in this process) for gs:// workdirs.

Every client memjax uses reaches it as it would reach Cloud Storage: gcsfs and
google-cloud-storage through STORAGE_EMULATOR_HOST, TensorStore (orbax's arrays) through
TENSORSTORE_GCS_HTTP_URL, in this process and in the training processes the tests start.

The emulator lacks two things of the Cloud Storage API that memjax's clients rely on, which
`start` adds to its handlers as the API defines them: the `ifGenerationMatch` precondition on
uploads, deletes and downloads (https://cloud.google.com/storage/docs/request-preconditions: 412 unless the
object's live generation equals the given one, 0 meaning no live object), which the run lock
uses, and the `x-goog-generation` header of media downloads, from which TensorStore (orbax)
learns the generation of what it read. The server handles one request at a time, so a check and
its write are atomic as on Cloud Storage.
"""

import contextlib
import logging
import os
import socket
from http import HTTPStatus
from typing import Iterator

BUCKET = 'memjax-test'


def _generation(storage, bucket: str, name: str) -> str:
    from gcp_storage_emulator.exceptions import NotFound  # pylint: disable=g-import-not-at-top
    try:
        return str(storage.get_file_obj(bucket, name)['generation'])
    except NotFound:
        return '0'


def _with_precondition(handler, object_name):
    def checked(request, response, storage, *args, **kwargs):
        wanted = request.query.get('ifGenerationMatch')
        if wanted and _generation(storage, request.params['bucket_name'],
                                  object_name(request)) != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({'error': {'code': 412, 'message': 'conditionNotMet',
                                     'errors': [{'reason': 'conditionNotMet'}]}})
            return None
        return handler(request, response, storage, *args, **kwargs)
    checked.precondition = True
    return checked


def _upload_name(request):
    if 'name' in request.query:
        return request.query['name'][0]
    if request.query.get('uploadType', [''])[0] == 'multipart':
        return request.data['meta'].get('name')
    return (request.data or {}).get('name')


def _with_generation_headers(download):
    """Media downloads honour `ifGenerationMatch` and carry the object's generation in headers, as
    on Cloud Storage; TensorStore reads it there (the emulator leaves them out)."""
    def with_headers(request, response, storage, *args, **kwargs):
        generation = _generation(storage, request.params['bucket_name'], request.params['object_id'])
        wanted = request.query.get('ifGenerationMatch')
        if wanted and generation != wanted[0]:
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({'error': {'code': 412, 'message': 'conditionNotMet'}})
            return None
        result = download(request, response, storage, *args, **kwargs)
        if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            response['x-goog-generation'] = generation
            response['x-goog-metageneration'] = '1'
        return result
    with_headers.precondition = True
    return with_headers


def _add_preconditions() -> None:
    from gcp_storage_emulator import server  # pylint: disable=g-import-not-at-top
    from gcp_storage_emulator.handlers import objects  # pylint: disable=g-import-not-at-top
    if getattr(objects.download, 'precondition', False):
        return  # Added already (one server per test process, but be safe).
    patched = {objects.insert: _with_precondition(objects.insert, _upload_name),
               objects.delete: _with_precondition(objects.delete, lambda r: r.params['object_id']),
               objects.download: _with_generation_headers(objects.download)}
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler in patched:
                handlers[method] = patched[handler]
    objects.download = patched[objects.download]  # objects.get calls it for ?alt=media.


def objects(prefix: str) -> dict[str, dict]:
    """{name below gs://BUCKET/prefix: its metadata (size, generation, crc32c, ...)}."""
    import fsspec  # pylint: disable=g-import-not-at-top
    root = f'{BUCKET}/{prefix}'.rstrip('/')
    return {name[len(root) + 1:]: info
            for name, info in fsspec.filesystem('gcs').find(root, detail=True).items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


ENV_KEYS = ('STORAGE_EMULATOR_HOST', 'TENSORSTORE_GCS_HTTP_URL', 'GOOGLE_AUTH_TOKEN_FOR_TESTING',
            'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'GOOGLE_CLOUD_PROJECT')


@contextlib.contextmanager
def start() -> Iterator[str]:
    """Serves an empty bucket BUCKET until the block ends; yields its base URL. The environment
    points every Cloud Storage client at it meanwhile."""
    from gcp_storage_emulator.server import create_server  # pylint: disable=g-import-not-at-top
    _add_preconditions()
    port = _free_port()
    server = create_server('127.0.0.1', port, in_memory=True, default_bucket=BUCKET)
    server.start()
    # Clients that close a connection early (TensorStore) and reads of absent objects are normal
    # traffic, which the emulator would print as tracebacks and errors.
    server._api._httpd.handle_error = lambda request, address: None  # pylint: disable=protected-access
    logging.getLogger('gcp_storage_emulator').setLevel(logging.CRITICAL)
    url = f'http://127.0.0.1:{port}'
    before = {key: os.environ.get(key) for key in ENV_KEYS}
    os.environ.update({
        'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
        # TensorStore asks GCE's metadata server for a token unless it is given one.
        'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
        # gcsfs would ask the storage-control API (absent here) about each bucket's layout.
        'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false', 'GOOGLE_CLOUD_PROJECT': 'memjax-test'})
    try:
        yield url
    finally:
        server.stop()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
