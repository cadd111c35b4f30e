"""Processes and collectives: the ``Comm`` wrapper over ``torch.distributed``
(``comm``), the same-host shared-memory all-reduce and all-gather
(``shm_collectives``), worker groups (``launcher``, with this process's own
rank in ``local_worker`` and how failures travel in ``failures``), a ``torchrun`` job's
ranks over one machine or several (``torchrun_group``, watched by ``watchdog``), emulated
links and machines between network namespaces (``emulated_link``, ``emulated_hosts``)."""
