# The compiled extension service/overload/budget.c (built by setup.py). Its types are its Python twin's,
# service/overload/books.py; tests/service/test_budget_books.py holds this stub's names equal to the compiled
# module's and the twins' signatures equal.
from collections.abc import Callable

from indexer_service.service.overload.books import PyBooks, PyTicket

Books = PyBooks
Ticket = PyTicket

class FastAdmit:
    def __init__(
        self,
        call: object,
        heavy_request_bytes: int,
        chunk_cost_bytes: int,
        books: PyBooks,
        general: Callable[[int, int], object],
        stop_if_abandoned: Callable[[object], None],
    ) -> None: ...
    def __call__(self, response_bytes: int, answer_bytes: int, /) -> object: ...

def watch(watched: dict, seconds: float, ticket: PyTicket, on_unread: Callable[[], object], /) -> None: ...
